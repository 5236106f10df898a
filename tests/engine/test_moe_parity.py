"""The native MoE models against transformers, their numerical oracle.

Tiny random-weight checkpoints of each MoE architecture (tests/engine/moe_models.py)
run (a) through the paged cache as the engine drives it (`PagedRunner` of the Llama
parity tests: flattened mixed steps, shuffled block tables, prompts in chunks), every
logit row compared with transformers; (b) through the whole `EngineCore` (scheduler,
batching, chunked prefill, preemption), greedy output token-identical to `generate`.
The prompts route tokens to every expert of every layer (checked), so a mis-loaded or
mis-weighted expert cannot hide.

gpt-oss (attention sinks, YaRN rope, alternating 8-token windows the prompts run past,
biased attention) goes through every test here as one more MoE architecture; the tests at
the end show its sinks and windows matter (without them the same checks fail).
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.layers.attention import Attention
from engine.layers.moe import (
    EXPERT_LINEARS,
    GROUPED_GEMM,
    FusedMoE,
    SparseMoeBlock,
    TopKRouter,
    use_moe_method,
)
from engine.model_loader import load_model
from engine.models.registry import get_model_class
from tests.engine.moe_models import CONFIGS, VOCAB, one_thread, save_tiny_moe
from tests.engine.test_greedy_parity import _generate as greedy_outputs
from tests.engine.test_llama_parity import PagedRunner, _prompts, windows_lifted

ATOL = 1e-4
RTOL = 1e-4
NEW_TOKENS = 16


def _quiet(_: str) -> None:
    """Progress sink: keep test output clean."""


class MoeCheckpoint:
    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.dir = directory
        self.hf = save_tiny_moe(name, directory)
        self.model, self.config = load_model(
            str(directory), torch.float32, torch.device("cpu"), progress=_quiet
        )

    @torch.no_grad()
    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        with one_thread():
            return self.hf(torch.tensor([tokens])).logits[0].float()

    @functools.cached_property
    def reference(self) -> list[list[int]]:
        """transformers' greedy continuations of `PROMPTS`, each generated alone."""
        return [self.hf_generate(p) for p in PROMPTS]

    @torch.no_grad()
    def hf_generate(self, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        with one_thread():
            out = self.hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MoeCheckpoint:
    return MoeCheckpoint(request.param, tmp_path_factory.mktemp(request.param))


# Prompts of mixed lengths, shared by the tests below (and the routing check).
PROMPTS = _prompts(5, [7, 1, 23, 40, 12], vocab=VOCAB, seed=3)


def test_registry_names_the_moe_architectures(ckpt: MoeCheckpoint) -> None:
    arch = ckpt.config.architectures[0]
    assert type(ckpt.model) is get_model_class(ckpt.config) and type(ckpt.model).__name__ == arch


def test_qwen3_moe_sparse_layers_are_transformers_choice() -> None:
    """mlp_only_layers and decoder_sparse_step pick the same sparse layers as transformers."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from engine.models.qwen3_moe import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=16, hidden_size=16, intermediate_size=8, moe_intermediate_size=8,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=2, num_experts_per_tok=1, decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_config(config)
    ours = Qwen3MoeForCausalLM(config, torch.float32, torch.device("cpu"))
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    our_sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert our_sparse == hf_sparse == [False, True, False, False, False, True]


def _hf_stacked(name: str, hf: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' stacked expert weights in hearth's layout: w13 [E, 2I, H], w2 [E, H, I]
    (gpt-oss stores them transposed, gate and up interleaved in the columns)."""
    if name != "gpt-oss":
        return hf.gate_up_proj, hf.down_proj
    gate_up = hf.gate_up_proj  # [E, H, 2I]
    w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
    return w13, hf.down_proj.transpose(1, 2)


def test_stacked_experts_hold_the_checkpoint_tensors(ckpt: MoeCheckpoint) -> None:
    """Per-expert checkpoint tensors land in the stacked weights (the Linears are views)."""
    moes = [m for m in ckpt.model.modules() if isinstance(m, FusedMoE)]
    assert moes
    hf_experts = [m for n, m in ckpt.hf.named_modules() if n.endswith(".experts")]
    assert len(hf_experts) == len(moes)
    for moe, hf in zip(moes, hf_experts, strict=True):
        w13, w2 = _hf_stacked(ckpt.name, hf)
        torch.testing.assert_close(moe.w13, w13, atol=0, rtol=0)
        torch.testing.assert_close(moe.w2, w2, atol=0, rtol=0)
        for e in range(moe.num_experts):
            assert moe.gate_up[e].weight.data_ptr() == moe.w13[e].data_ptr()
            assert moe.down[e].weight.data_ptr() == moe.w2[e].data_ptr()
    # Stacked buffers are not parameters: each expert weight is counted once.
    counted = sum(p.numel() for p in ckpt.model.parameters())
    assert counted == sum(p.numel() for p in ckpt.hf.parameters())


def test_every_expert_is_routed_to(ckpt: MoeCheckpoint) -> None:
    """The parity prompts reach every expert of every MoE layer, so each expert's weights
    are exercised by the comparisons below."""
    routers = [m for m in ckpt.model.modules() if isinstance(m, TopKRouter)]
    counts: list[Counter[int]] = [Counter() for _ in routers]

    def record(i: int):
        def hook(_m, _inp, out) -> None:
            counts[i].update(out[1].flatten().tolist())

        return hook

    handles = [r.register_forward_hook(record(i)) for i, r in enumerate(routers)]
    try:
        PagedRunner(ckpt.model, block_size=4).step([(f"s{i}", p) for i, p in enumerate(PROMPTS)])
    finally:
        for h in handles:
            h.remove()
    for layer, (router, seen) in enumerate(zip(routers, counts, strict=True)):
        num_experts = router.gate.out_features
        assert set(seen) == set(range(num_experts)), (layer, dict(seen))
        assert sum(seen.values()) == router.top_k * sum(len(p) for p in PROMPTS)


@pytest.mark.parametrize("method", [EXPERT_LINEARS, GROUPED_GEMM], ids=lambda m: m.name)
def test_batched_prefill_matches_transformers(ckpt: MoeCheckpoint, method) -> None:
    """Prompts of mixed lengths in ONE step: every token's logits, by either MoE method
    (the grouped GEMM's torch reference here; its Triton kernel: tests/kernels)."""
    use_moe_method(ckpt.model, method)
    try:
        out = PagedRunner(ckpt.model, block_size=4).step(
            [(f"s{i}", p) for i, p in enumerate(PROMPTS)], all_rows=True
        )
    finally:
        use_moe_method(ckpt.model, EXPERT_LINEARS)
    for prompt, logits in zip(PROMPTS, out, strict=True):
        torch.testing.assert_close(logits, ckpt.hf_logits(prompt), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_mixed_with_decodes(ckpt: MoeCheckpoint) -> None:
    a, b, c = _prompts(3, [37, 9, 12], vocab=VOCAB, seed=5)
    a_more, b_more, c_more = _prompts(3, [3, 6, 4], vocab=VOCAB, seed=6)
    full = {"a": a + a_more, "b": b + b_more, "c": c + c_more}
    oracle = {s: ckpt.hf_logits(toks) for s, toks in full.items()}
    runner = PagedRunner(ckpt.model, block_size=4, seed=1)
    steps: list[list[tuple[str, list[int]]]] = [
        [("a", a[:13]), ("b", b)],
        [("b", [b_more[0]]), ("a", a[13:29]), ("c", c)],
        [("b", [b_more[1]]), ("c", [c_more[0]]), ("a", a[29:])],
        [("a", [a_more[0]]), ("b", [b_more[2]]), ("c", [c_more[1]])],
        [("c", [c_more[2]]), ("a", a_more[1:3]), ("b", b_more[3:6])],
    ]
    for n, work in enumerate(steps):
        for (seq, tokens), logits in zip(work, runner.step(work, all_rows=True), strict=True):
            end = runner.cached[seq]
            want = oracle[seq][end - len(tokens) : end]
            torch.testing.assert_close(
                logits, want, atol=ATOL, rtol=RTOL, msg=lambda m, s=seq, i=n: f"step {i} {s}: {m}"
            )


def test_greedy_decode_matches_generate(ckpt: MoeCheckpoint) -> None:
    runner = PagedRunner(ckpt.model, block_size=8, seed=2)
    seqs = [f"g{i}" for i in range(len(PROMPTS))]
    generated: list[list[int]] = [[] for _ in PROMPTS]
    rows = runner.step(list(zip(seqs, PROMPTS, strict=True)))
    for _ in range(NEW_TOKENS):
        for out, logits in zip(generated, rows, strict=True):
            out.append(int(logits.argmax()))
        rows = runner.step([(s, [g[-1]]) for s, g in zip(seqs, generated, strict=True)])
    assert generated == ckpt.reference


def test_bfloat16_forward_is_close(ckpt: MoeCheckpoint) -> None:
    model, _ = load_model(str(ckpt.dir), torch.bfloat16, torch.device("cpu"), progress=_quiet)
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert moe.w13.dtype == torch.bfloat16
    (logits,) = PagedRunner(model, block_size=4).step([("x", PROMPTS[2])])
    ref = ckpt.hf_logits(PROMPTS[2])[-1]
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouped_gemm_matches_transformers(ckpt: MoeCheckpoint) -> None:
    """Mixed prefill/decode steps on CUDA, the experts by the Triton grouped GEMM (what
    `choose_backends` picks there), against the CPU oracle."""
    a, b = _prompts(2, [29, 6], vocab=VOCAB, seed=11)
    oracle = {"a": ckpt.hf_logits(a), "b": ckpt.hf_logits([*b, 3, 4])}
    steps = [[("a", a[:20]), ("b", b)], [("b", [3]), ("a", a[20:])], [("b", [4])]]
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 0.1)):
        model, _ = load_model(str(ckpt.dir), dtype, torch.device("cuda"), progress=_quiet)
        assert use_moe_method(model, GROUPED_GEMM) > 0
        runner = PagedRunner(model, block_size=16, device="cuda")
        for work in steps:
            for (seq, tokens), logits in zip(work, runner.step(work, all_rows=True), strict=True):
                end = runner.cached[seq]
                want = oracle[seq][end - len(tokens) : end]
                err = (logits - want).abs().max().item()
                assert err <= tol * max(1.0, want.abs().max().item()), (dtype, seq, err)


# ------------------------------------------------------------------------------------
# the whole engine: scheduler, batching, chunked prefill, preemption
# ------------------------------------------------------------------------------------


def _engine_generate(core, prompts: list[list[int]], tag: str, at_once: bool) -> list[list[int]]:
    return greedy_outputs(core, prompts, tag, at_once, max_tokens=NEW_TOKENS, ignore_eos=True)


def _core(ckpt: MoeCheckpoint, **overrides):
    from engine.core import EngineCore

    return EngineCore(EngineConfig(model=str(ckpt.dir), dtype="float32", **overrides))


def test_engine_greedy_matches_generate_alone_batched_chunked_preempted(
    ckpt: MoeCheckpoint,
) -> None:
    reference = ckpt.reference
    core = _core(ckpt, max_model_len=128)
    assert _engine_generate(core, PROMPTS, "alone", at_once=False) == reference
    hits = core.block_manager.num_prefix_hits
    # The same prompts again, all at once: their full blocks come from the prefix cache.
    assert _engine_generate(core, PROMPTS, "batch", at_once=True) == reference
    assert core.block_manager.num_prefix_hits > hits
    # An 8-token budget: the 23- and 40-token prompts prefill over several steps,
    # interleaved with the other sequences' decodes.
    chunked = _core(ckpt, max_model_len=128, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _engine_generate(chunked, PROMPTS, "chunked", at_once=True) == reference
    # 8 blocks of 4 slots for five sequences of up to 60 tokens: running sequences are
    # preempted (blocks freed, recomputed later) for the batch to finish.
    small = _core(ckpt, num_kv_blocks=16, block_size=4, max_num_batched_tokens=64)
    assert _engine_generate(small, PROMPTS, "preempt", at_once=True) == reference
    assert small.scheduler.num_preemptions > 0


# ------------------------------------------------------------------------------------
# gpt-oss's MoE block alone
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [EXPERT_LINEARS, GROUPED_GEMM], ids=lambda m: m.name)
def test_gpt_oss_moe_block_matches_transformers(method) -> None:
    """Bias-ed top-k-then-softmax router, bias-ed experts, clamped SwiGLU, and the stacked
    interleaved checkpoint tensors split per expert: transformers' `GptOssMLP` output."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from engine.models.gpt_oss import gpt_oss_moe, split_stacked_experts
    from engine.models.weights import load_checkpoint
    from tests.engine.tiny_models import randomize

    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, experts_implementation="eager"
    )
    randomize(hf, seed=1)
    hf_mlp = hf.model.layers[0].mlp.eval()
    prefix = "model.layers.0.mlp"
    block = gpt_oss_moe(config, prefix, torch.float32, torch.device("cpu"))
    load_checkpoint(
        block, split_stacked_experts((f"{prefix}.{k}", v) for k, v in hf_mlp.state_dict().items())
    )
    use_moe_method(block, method)
    x = 4.0 * torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    gate_up = torch.einsum("th,eih->eti", x, block.experts.w13)  # [E, T, 2I]
    inter = config.intermediate_size
    assert (gate_up[..., :inter] > 7).any() and (
        gate_up[..., inter:].abs() > 7
    ).any()  # clamps bite
    with torch.no_grad(), one_thread():
        want, _ = hf_mlp(x[None])
        got = block(x)
    _, ids = block.router(x)
    assert set(ids.flatten().tolist()) == set(range(4))  # every expert routed to
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------
# gpt-oss: its sinks and windows are what the parity above checks
# ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> MoeCheckpoint:
    return MoeCheckpoint("gpt-oss", tmp_path_factory.mktemp("gpt-oss-sinks"))


def _attention_layers(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_gpt_oss_layout(gpt_oss: MoeCheckpoint) -> None:
    """Sinks loaded onto each attention layer, alternating windows as transformers sets
    them, biased q/k/v/o, YaRN's scaled table."""
    layers = _attention_layers(gpt_oss.model)
    hf_layers = gpt_oss.hf.model.layers
    assert (
        [a.sliding_window for a in layers]
        == [layer.self_attn.sliding_window for layer in hf_layers]
        == [8, None, 8, None]
    )
    for attn, hf_layer in zip(layers, hf_layers, strict=True):
        assert attn.sinks is not None
        assert torch.equal(attn.sinks, hf_layer.self_attn.sinks)
        assert attn.sinks.abs().max() > 1.0  # strong_sinks: far from randomize's 0.15
    attention = gpt_oss.model.model.layers[0].self_attn
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is not None
    assert gpt_oss.model.sliding_window is None  # global layers keep every block
    cos_sin = attention.rotary_emb.cos_sin_cache
    assert cos_sin[:, :8].abs().max() > 1.0  # YaRN's attention factor scales cos


@pytest.mark.parametrize("sinks", ["ignored", "zero"])
def test_gpt_oss_sinks_decide_the_logits(gpt_oss: MoeCheckpoint, sinks: str) -> None:
    """A kernel that ignored the sinks (a logit of -inf) or had them at zero would fail
    the parity bound by orders of magnitude, and change greedy tokens."""
    layers = _attention_layers(gpt_oss.model)
    saved = [a.sinks.detach().clone() for a in layers if a.sinks is not None]
    prompt = PROMPTS[3]  # 40 tokens, past the 8-token window
    want = gpt_oss.hf_logits(prompt)
    try:
        with torch.no_grad():
            for attn in layers:
                assert attn.sinks is not None
                attn.sinks.fill_(float("-inf") if sinks == "ignored" else 0.0)
        (got,) = PagedRunner(gpt_oss.model, block_size=4).step([("x", prompt)], all_rows=True)
    finally:
        with torch.no_grad():
            for attn, value in zip(layers, saved, strict=True):
                assert attn.sinks is not None
                attn.sinks.copy_(value)
    assert (got - want).abs().max() > 100 * ATOL
    assert (got.argmax(-1) != want.argmax(-1)).any()
    (restored,) = PagedRunner(gpt_oss.model, block_size=4).step([("x", prompt)], all_rows=True)
    torch.testing.assert_close(restored, want, atol=ATOL, rtol=RTOL)


def test_gpt_oss_windows_decide_the_logits(gpt_oss: MoeCheckpoint) -> None:
    """Without its windows (every layer global) the model misses transformers' logits past
    the window: the sliding layers are exercised by the prompts."""
    layers = _attention_layers(gpt_oss.model)
    prompt = PROMPTS[3]
    with windows_lifted(layers):
        (got,) = PagedRunner(gpt_oss.model, block_size=4).step([("x", prompt)], all_rows=True)
    want = gpt_oss.hf_logits(prompt)
    torch.testing.assert_close(got[:8], want[:8], atol=ATOL, rtol=RTOL)  # inside the window
    assert (got[8:] - want[8:]).abs().max() > 100 * ATOL


def test_gpt_oss_refuses_the_c_attention_kernel(gpt_oss: MoeCheckpoint) -> None:
    """The CPU fast path's C attention has no sink term: the backend check says so (so
    `choose_backends` never picks it for gpt-oss) and the kernel refuses a sinks layer."""
    from engine.attention import CpuAttentionBackend
    from engine.layers.attention import has_sinks

    assert has_sinks(gpt_oss.model)
    why = CpuAttentionBackend.supported(16, torch.float32, torch.device("cpu"), sinks=True)
    assert why is not None and "sinks" in why
    layer = _attention_layers(gpt_oss.model)[0]
    q = torch.zeros(1, layer.num_heads, layer.head_dim)
    kv = torch.zeros(1, layer.num_kv_heads, layer.head_dim)
    saved = (layer.kv_cache, layer.backend)
    cache = torch.zeros(2, 4, layer.num_kv_heads, layer.head_dim)
    backend = CpuAttentionBackend()
    try:
        layer.bind((cache, cache.clone()), backend)
        from kernels.metadata import SeqSpan

        meta = backend.build_metadata([SeqSpan(0, 1, [0])], [0], 4, torch.device("cpu"))
        with pytest.raises(ValueError, match="sinks"):
            layer(q, kv, kv, meta)
    finally:
        layer.kv_cache, layer.backend = saved
