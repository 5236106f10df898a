"""MoE models on the CPU fast path: each layer's experts packed (Q8_0 quantized at load)
run in one C call (`engine/layers/moe.py` `PackedExpertsMoEMethod`), computing what the
expert-by-expert path over the same packed linears computes (`ExpertLinearsMoEMethod`;
only the activation's exp may round differently), prompts routed to every expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.layers.moe import (
    EXPERT_LINEARS,
    PACKED_EXPERTS,
    FusedMoE,
    SparseMoeBlock,
    use_moe_method,
)
from kernels.cpu import ops
from tests.engine.engine_runs import greedy_runs
from tests.engine.moe_models import CONFIGS, VOCAB
from tests.engine.tiny_models import save_random_config
from tests.gpu.gpu_models import write_tokenizer

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2: no C kernels here")


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_packed_experts_run_in_one_call_and_compute_what_the_expert_linears_do(
    name: str, tmp_path: Path
) -> None:
    config = CONFIGS[name]()
    config.head_dim = 32  # the C attention's unit
    save_random_config(config, tmp_path)
    write_tokenizer(tmp_path, VOCAB)
    core = EngineCore(EngineConfig(model=str(tmp_path), quantization="q8_0", max_model_len=96))
    moe = [m for m in core.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.method is PACKED_EXPERTS for m in moe)
    assert f"{len(moe)} MoE layers' experts in one C call each" in core.backends.description
    routed: set[tuple[int, int]] = set()
    blocks = [b for b in core.model.modules() if isinstance(b, SparseMoeBlock)]
    for i, b in enumerate(blocks):  # which experts the prompts reach (the router's top k)
        b.router.gate.register_forward_hook(
            lambda _m, _args, logits, i=i, k=b.router.top_k: routed.update(
                (i, int(e)) for e in logits.topk(k, dim=-1).indices.reshape(-1)
            )
        )
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 23, 41)]
    got = greedy_runs(core, prompts, 8)
    assert routed == {(i, e) for i, m in enumerate(moe) for e in range(m.num_experts)}
    assert use_moe_method(core.model, EXPERT_LINEARS) == len(moe)
    want = greedy_runs(core, prompts, 8)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), atol=1e-4, rtol=0)


def test_experts_with_lora_hooks_take_the_expert_linears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `--enable-lora` a Qwen3-MoE's experts carry LoRA hooks (their projections are
    targets; Mixtral's w1/w3/w2 are not): the layer runs expert by expert, so an adapter's
    term is added, and the one C call only where no hook is."""
    calls: list[str] = []
    real = EXPERT_LINEARS.apply
    monkeypatch.setattr(
        EXPERT_LINEARS, "apply", lambda *a, **k: calls.append("linears") or real(*a, **k)
    )
    for name, hooked in (("qwen3-moe", True), ("mixtral", False)):
        config = CONFIGS[name]()
        config.head_dim = 32
        directory = tmp_path / name
        save_random_config(config, directory)
        write_tokenizer(directory, VOCAB)
        core = EngineCore(
            EngineConfig(
                model=str(directory), quantization="q8_0", max_model_len=96, enable_lora=True
            )
        )
        moe = [m for m in core.model.modules() if isinstance(m, FusedMoE)]
        assert all(m.method is PACKED_EXPERTS for m in moe)
        assert all((e.lora is not None) == hooked for m in moe for e in (*m.gate_up, *m.down))
        calls.clear()
        greedy_runs(core, [[5, 6, 7]], 2)
        assert bool(calls) == hooked, name
