"""LoRA over the CPU fast path (the default model's GGUF blocks, C kernels): the adapter
term is added after the GGUF linear method. An adapter whose B is zero leaves every token
as the base's (the adapter path runs op by op; the base steps replay the step program),
a random one changes them as the exact mode's adapter does (the fast path adds the term
with the C kernel `hearth_lora`), and an adapter's tokens do not depend on what else
shares its steps (the base, another adapter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams
from tests.lora_adapters import write_random_adapter

pytestmark = pytest.mark.slow

PROMPTS = [[504, 3200, 77, 9, 1201, 45, 18, 86], [1, 88, 17, 2330, 641, 12, 9, 400, 3, 71]]
NEW_TOKENS = 12


def _run(core: EngineCore, jobs: list[tuple[str, list[int], str | None]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for rid, prompt, lora in jobs:
        msg = AddRequest(request_id=rid, prompt_token_ids=prompt, params=params, lora_name=lora)
        assert core.add_request(msg).accepted
    out: dict[str, list[int]] = {}
    while core.has_work():
        for _, o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_lora_on_the_gguf_fast_path(model_smollm2_dir: str, tmp_path: Path) -> None:
    zero = write_random_adapter(model_smollm2_dir, tmp_path / "zero", seed=1, b_scale=0.0)
    tuned = write_random_adapter(model_smollm2_dir, tmp_path / "tuned", seed=2, b_scale=0.05)
    core = EngineCore(
        EngineConfig(
            enable_lora=True,
            lora_modules=(("zero", zero), ("tuned", tuned)),
            max_loras=2,
            num_kv_blocks=64,
            max_model_len=512,
            quantization="gguf",  # token equality alone vs mixed: the batch-invariant mode
        )
    )
    assert core.backends.quantization == "gguf"
    from engine.layers.linear import Linear
    from kernels.cpu import ops

    hooks = [m.lora for m in core.model.modules() if isinstance(m, Linear) and m.lora]
    assert hooks and all(h.add_lora is ops.add_lora for h in hooks), "the C LoRA kernel"
    alone = {
        lora: _run(core, [(f"{lora}-{i}", p, lora) for i, p in enumerate(PROMPTS)])
        for lora in (None, "zero", "tuned")
    }
    for i in range(len(PROMPTS)):
        assert alone["zero"][f"zero-{i}"] == alone[None][f"None-{i}"]
        assert alone["tuned"][f"tuned-{i}"] != alone[None][f"None-{i}"]
    mixed = _run(
        core,
        [
            (f"m-{lora}-{i}", p, lora)
            for i, p in enumerate(PROMPTS)
            for lora in (None, "zero", "tuned")
        ],
    )
    for i in range(len(PROMPTS)):
        for lora in (None, "zero", "tuned"):
            assert mixed[f"m-{lora}-{i}"] == alone[lora][f"{lora}-{i}"], (lora, i)
    # The C LoRA term is the exact mode's (torch, PEFT's order): the same greedy tokens.
    exact = EngineCore(
        EngineConfig(
            enable_lora=True, lora_modules=(("tuned", tuned),), num_kv_blocks=64,
            max_model_len=512, quantization="none",
        )
    )  # fmt: skip
    reference = _run(exact, [(f"tuned-{i}", p, "tuned") for i, p in enumerate(PROMPTS)])
    assert reference == alone["tuned"]
