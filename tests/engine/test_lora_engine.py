"""LoRA in the engine core: a step mixing the base and three adapters is token-identical
to transformers + PEFT on each (float32, exact mode); slots are loaded on demand and
evicted least recently used; a full set of pinned slots refuses with 503's kind; the
prefix cache never shares KV across adapters; the registry commands; and the LoRA term
is added after whatever linear method a layer has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.layers.linear import Linear, LinearMethod, Shard
from engine.lora.adapter import max_adapter_bytes
from engine.lora.layer import LinearLoRA, LoRAContext
from engine.messages import AdapterCommand, AddRequest
from engine.sampling_params import SamplingParams
from kernels import LoRAStep
from kernels.reference_lora import add_lora
from tests.lora_adapters import make_adapter, make_adapters, reference_tokens, tiny_llama

pytestmark = pytest.mark.slow  # transformers + PEFT references: about a minute here

NEW_TOKENS = 10
PROMPTS = [[1, 504, 3200, 77, 9, 1201, 45], [1, 88, 17, 2330, 641, 12, 9, 9, 400, 3, 71]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, model_smollm2_dir: str) -> str:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), model_smollm2_dir)


@pytest.fixture(scope="module")
def adapters(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_adapters(tiny_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def references(tiny_dir: str, adapters: dict[str, str]) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {
        None: reference_tokens(tiny_dir, None, PROMPTS, NEW_TOKENS)
    }
    for name, path in adapters.items():
        refs[name] = reference_tokens(tiny_dir, path, PROMPTS, NEW_TOKENS)
    return refs


def _core(tiny_dir: str, adapters: dict[str, str], names: list[str], max_loras: int) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=tiny_dir,
            dtype="float32",
            enable_lora=True,
            lora_modules=tuple((n, adapters[n]) for n in names),
            max_loras=max_loras,
            max_lora_rank=16,
            num_kv_blocks=128,
            max_model_len=256,
            block_size=4,
        )
    )


def _add(core: EngineCore, rid: str, prompt: list[int], lora: str | None):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return core.add_request(
        AddRequest(request_id=rid, prompt_token_ids=prompt, params=params, lora_name=lora)
    )


def _run(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_work():
        for _, o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_adapters_change_the_output(references: dict[str | None, list[list[int]]]) -> None:
    """The check below means something only if every adapter moves the tokens."""
    for name in ("alpha", "beta", "gamma", "delta"):
        assert references[name] != references[None], name


def test_one_step_mixing_base_and_adapters_is_token_identical_to_peft(
    tiny_dir: str, adapters: dict[str, str], references: dict[str | None, list[list[int]]]
) -> None:
    core = _core(tiny_dir, adapters, ["alpha", "beta", "gamma"], max_loras=3)
    assert core.lora is not None
    seen: list[set[int]] = []
    begin = core.lora.begin_step
    core.lora.begin_step = lambda slots: (seen.append(set(slots)), begin(slots))[1]  # type: ignore[method-assign]
    jobs = [
        (f"{lora}-{i}", p, lora)
        for lora in (None, "alpha", "beta", "gamma")
        for i, p in enumerate(PROMPTS)
    ]
    for rid, prompt, lora in jobs:
        admission = _add(core, rid, prompt, lora)
        assert admission is not None and admission.accepted, admission
    got = _run(core)
    assert {-1, 0, 1, 2} <= seen[0]  # the first step ran the base and all three adapters
    for rid, _, lora in jobs:
        i = int(rid.rsplit("-", 1)[1])
        assert got[rid] == references[lora][i], rid


def test_slots_load_on_demand_lru_and_refuse_when_all_pinned(
    tiny_dir: str, adapters: dict[str, str], references: dict[str | None, list[list[int]]]
) -> None:
    core = _core(tiny_dir, adapters, ["alpha", "beta", "delta"], max_loras=1)
    assert _add(core, "a0", PROMPTS[0], "alpha").accepted
    refused = _add(core, "b0", PROMPTS[0], "beta")
    assert not refused.accepted and refused.error_kind == "overloaded"
    assert "--max-loras" in refused.message
    assert _add(core, "base", PROMPTS[0], None).accepted  # the base needs no slot
    got = _run(core)
    assert got["a0"] == references["alpha"][0] and got["base"] == references[None][0]
    # alpha's slot is free (unpinned) now: beta evicts it, then delta evicts beta.
    for name, rid in (("beta", "b1"), ("delta", "d1"), ("alpha", "a1")):
        assert _add(core, rid, PROMPTS[1], name).accepted
        assert _run(core)[rid] == references[name][1], name
    status = {s.name: s.resident for s in core.lora.status()}
    assert status == {"alpha": True, "beta": False, "delta": False}


def test_unknown_adapter_is_not_found(tiny_dir: str, adapters: dict[str, str]) -> None:
    core = _core(tiny_dir, adapters, ["alpha"], max_loras=1)
    admission = _add(core, "x", PROMPTS[0], "nope")
    assert not admission.accepted and admission.error_kind == "not_found"
    assert "nope" in admission.message


def test_prefix_cache_is_per_adapter(tiny_dir: str, adapters: dict[str, str]) -> None:
    core = _core(tiny_dir, adapters, ["alpha", "beta"], max_loras=2)
    prompt = list(range(10, 50))  # ten full blocks of 4
    cached: dict[str, int] = {}
    for rid, lora in (
        ("base", None),
        ("a", "alpha"),
        ("b", "beta"),
        ("a2", "alpha"),
        ("base2", None),
    ):
        assert _add(core, rid, prompt, lora).accepted
        while core.has_work():
            for _, out in core.step():
                if out.num_prompt_tokens and rid not in cached:
                    cached[rid] = out.num_cached_tokens
    assert cached["a"] == 0 and cached["b"] == 0  # nothing taken from the base or each other
    assert cached["a2"] > 0 and cached["base2"] > 0  # but each reuses its own


def test_registry_commands(tiny_dir: str, adapters: dict[str, str], tmp_path: Path) -> None:
    core = _core(tiny_dir, adapters, ["alpha"], max_loras=2)

    def cmd(op: str, name: str | None = None, path: str | None = None):
        return core.adapter_command(AdapterCommand(call_id="c", op=op, name=name, path=path))

    assert [c.name for c in cmd("list").adapters] == ["alpha"]
    assert cmd("load", "beta", adapters["beta"]).ok
    dup = cmd("load", "beta", adapters["beta"])
    assert not dup.ok and dup.error_kind == "conflict"
    big = make_adapter(
        tiny_dir, tmp_path / "big", seed=9, r=32, lora_alpha=32, target_modules=["q_proj"]
    )
    too_big = cmd("load", "big", big)
    assert not too_big.ok and too_big.error_kind == "invalid" and "max_lora_rank" in too_big.message
    missing = cmd("load", "ghost", str(tmp_path / "nothing"))
    assert not missing.ok and missing.error_kind == "invalid"
    # a lora_alpha that is not a number is the adapter's fault (400 / 424 on `src`), not
    # a name conflict (float("x")'s ValueError had read as one)
    odd = tmp_path / "odd"
    shutil.copytree(adapters["beta"], odd)
    config = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": "x"}))
    bad_alpha = cmd("load", "odd", str(odd))
    assert not bad_alpha.ok and bad_alpha.error_kind == "invalid", bad_alpha
    assert "lora_alpha" in bad_alpha.message
    # a file larger than any servable adapter (one carrying embeddings, say) is refused by
    # its size, before the engine's loop spends time reading it
    huge = tmp_path / "huge"
    shutil.copytree(adapters["beta"], huge)
    with open(huge / "adapter_model.safetensors", "ab") as f:
        f.truncate(max_adapter_bytes(core.lora.module_shapes, 16) + 1)
    oversized = cmd("load", "huge", str(huge))
    assert not oversized.ok and oversized.error_kind == "invalid", oversized
    assert "bytes" in oversized.message and "at most" in oversized.message
    assert _add(core, "r", PROMPTS[0], "beta").accepted
    assert cmd("unload", "beta").ok  # while a request runs on it: that request finishes
    assert _add(core, "r2", PROMPTS[0], "beta").error_kind == "not_found"
    assert len(_run(core)["r"]) == NEW_TOKENS
    gone = cmd("unload", "beta")
    assert not gone.ok and gone.error_kind == "not_found"
    assert [c.name for c in cmd("list").adapters] == ["alpha"]


def test_an_embedding_on_an_adapter_is_peft_models_last_hidden_state(
    tiny_dir: str, adapters: dict[str, str]
) -> None:
    """A pooled request naming an adapter runs it (the embeddings routes pass the model's
    adapter, as generation does): last-token pooling, normalised, equals transformers +
    PEFT's last hidden state of the same prompt with that adapter, and differs from the
    base model's."""
    import numpy as np
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.messages import PoolingParams

    core = _core(tiny_dir, adapters, ["alpha"], max_loras=1)
    for rid, lora in (("base", None), ("tuned", "alpha")):
        admission = core.add_request(
            AddRequest(
                request_id=rid, prompt_token_ids=PROMPTS[1], params=SamplingParams(),
                pooling=PoolingParams(), lora_name=lora,
            )
        )  # fmt: skip
        assert admission is not None and admission.accepted, admission
    vectors: dict[str, torch.Tensor] = {}
    while core.has_work():
        for _, out in core.step():
            if out.embedding is not None:
                vectors[out.request_id] = torch.from_numpy(
                    np.frombuffer(out.embedding, dtype="<f4").copy()
                )
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(base, adapters["alpha"]).eval()
    with torch.inference_mode():  # the last of hidden_states is after the final norm
        out = tuned(input_ids=torch.tensor([PROMPTS[1]]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0, -1]
    want = torch.nn.functional.normalize(hidden, dim=-1)
    assert torch.allclose(vectors["tuned"], want, atol=1e-5), (vectors["tuned"] - want).abs().max()
    assert not torch.allclose(vectors["base"], vectors["tuned"], atol=1e-3)


class _ScaledMethod(LinearMethod):
    """A stand-in for a quantized method: any result the adapter must add to."""

    name = "scaled"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return 3.0 * torch.nn.functional.linear(x, layer.weight)


def test_lora_term_is_added_after_any_linear_method() -> None:
    torch.manual_seed(0)
    linear = Linear(8, 12, [Shard("m.q_proj", 8), Shard("m.k_proj", 4)], bias=False,
                    dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    linear.weight.data.normal_()
    linear.method = _ScaledMethod()
    context = LoRAContext()
    linear.lora = LinearLoRA(context, [8, 4], 8, 2, 4, torch.float32, torch.device("cpu"))
    linear.lora.set_shard(1, 0, torch.randn(4, 8), torch.randn(8, 4), 2.0)
    x = torch.randn(3, 8)
    base = 3.0 * torch.nn.functional.linear(x, linear.weight)
    assert torch.equal(linear(x), base)  # no step: the method's result untouched
    context.step = LoRAStep.build([1, -1, 1], torch.device("cpu"))
    expected = add_lora(base.clone(), x, linear.lora.stack, context.step)
    got = linear(x)
    assert torch.equal(got, expected) and not torch.equal(got[0], base[0])
    assert torch.equal(got[1], base[1])
