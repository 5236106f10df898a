"""The native Llama-family model against transformers, its numerical oracle.

Tiny random-weight checkpoints (saved with `save_pretrained`, loaded with `load_model`)
run through the paged KV cache exactly as the engine drives it: flattened tokens of
several sequences per step, decodes first, block tables drawn from a shuffled pool,
prompts split into chunks across steps. Every logit row is compared with transformers
running each sequence alone, and greedy decoding must be token-identical to `generate`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, Qwen2Config

from engine.attention import PagedAttentionBackend
from engine.layers.attention import bind_attention
from engine.model_loader import load_model
from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, rope_config
from engine.models.registry import ARCHITECTURES, get_model_class
from kernels.metadata import SeqSpan
from tests.engine.tiny_models import CONFIGS, llama3_rope, llama_tied, save_tiny

ATOL = 1e-4
RTOL = 1e-4


def _quiet(_: str) -> None:
    """Progress sink: keep test output clean."""


# ------------------------------------------------------------------------------------
# tiny checkpoints (tests/engine/tiny_models.py)
# ------------------------------------------------------------------------------------


class Checkpoint:
    """A saved tiny checkpoint with its transformers model (oracle) and native model."""

    def __init__(self, name: str, directory: Path) -> None:
        hf = save_tiny(name, directory)
        self.name = name
        self.dir = directory
        self.hf = hf
        native, self.config = load_model(
            str(directory), torch.float32, torch.device("cpu"), progress=_quiet
        )
        assert isinstance(native, LlamaForCausalLM)
        self.model: LlamaForCausalLM = native

    @torch.no_grad()
    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        """transformers' logits [len(tokens), V] for one sequence alone."""
        return self.hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_ckpt(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    return Checkpoint(request.param, tmp_path_factory.mktemp(request.param))


# ------------------------------------------------------------------------------------
# a hand-rolled paged batch: the scheduler + block manager + runner in 60 lines
# ------------------------------------------------------------------------------------


@contextlib.contextmanager
def windows_lifted(attentions) -> Iterator[None]:
    """Run with every given attention layer's sliding window off (full attention), then
    put each window back: a model with its windows lifted must miss a windowed reference,
    which shows the windows are exercised."""
    saved = [a.sliding_window for a in attentions]
    try:
        for a in attentions:
            a.sliding_window = None
        yield
    finally:
        for a, window in zip(attentions, saved, strict=True):
            a.sliding_window = window


class PagedRunner:
    """Drives `model.forward` over the paged cache the way the engine does.

    Blocks come from a shuffled pool, so tables are non-contiguous. The cache starts
    full of large garbage: any read of a slot this step did not write (or a masked one
    leaking through) shows up as a logit mismatch.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        num_blocks: int = 96,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (
                (100.0 * torch.randn(shape, generator=gen)).to(self.device, model.dtype),
                (100.0 * torch.randn(shape, generator=gen)).to(self.device, model.dtype),
            )
            for _ in range(model.num_layers)
        ]
        self.attention = PagedAttentionBackend(model.dtype)
        bind_attention(model, self.kv_caches, self.attention)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}  # tokens already in the cache per sequence

    @torch.no_grad()
    def step(self, work: list[tuple[str, list[int]]], all_rows: bool = False) -> list[torch.Tensor]:
        """Run one step over `work` = [(seq_id, new_tokens)], decodes first.

        Returns, per work item, float32 logits [V] of its last token, or [len(new), V]
        of every new token when `all_rows` (the engine only ever asks for the last).
        """
        is_decode = [self.cached.get(s, 0) > 0 and len(t) == 1 for s, t in work]
        num_decodes = sum(is_decode)
        assert all(is_decode[:num_decodes]) and not any(is_decode[num_decodes:]), "decodes first"
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        for seq, tokens in work:
            table = self.tables.setdefault(seq, [])
            start = self.cached.get(seq, 0)
            for pos in range(start, start + len(tokens)):
                if pos // bs == len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // bs] * bs + pos % bs)
                positions.append(pos)
            ids.extend(tokens)
            self.cached[seq] = start + len(tokens)
            seq_lens.append(start + len(tokens))

        dev = self.device
        spans = [
            SeqSpan(length - len(tokens), len(tokens), self.tables[seq])
            for (seq, tokens), length in zip(work, seq_lens, strict=True)
        ]
        meta = self.attention.build_metadata(spans, slots, bs, dev, num_decodes=num_decodes)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
        )  # [T, H]
        assert hidden.shape == (len(ids), self.model.hidden_size)
        ends = torch.tensor([len(t) for _, t in work], device=dev).cumsum(0)  # [num_work]
        if not all_rows:
            logits = self.model.compute_logits(hidden[ends - 1])  # [num_work, V]
            return list(logits.cpu())
        logits = self.model.compute_logits(hidden)  # [T, V]
        return list(logits.cpu().split([len(t) for _, t in work]))


def _prompts(n: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=gen).tolist() for length in lengths[:n]]


# ------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------


def test_registry_maps_architectures() -> None:
    # Every tiny config resolves (by model_type: a fresh config names no architecture).
    for factory in CONFIGS.values():
        get_model_class(factory())
    assert {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    } <= set(ARCHITECTURES)  # fmt: skip
    assert get_model_class(Qwen2Config()) is Qwen2ForCausalLM
    cfg = PretrainedConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(cfg)


def test_rope_config_reads_v5_and_legacy_forms() -> None:
    theta, scaling = rope_config(llama3_rope())
    assert theta == 500000.0
    assert scaling is not None and scaling["rope_type"] == "llama3" and "rope_theta" not in scaling
    assert rope_config(llama_tied()) == (10000.0, None)
    # transformers 4 attribute names, as an old config object carries them.
    legacy = SimpleNamespace(
        rope_theta=1234.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=64,
    )
    assert rope_config(legacy) == (1234.0, {"rope_type": "linear", "factor": 2.0})


def _hf_windows(hf: torch.nn.Module) -> list[int | None]:
    """transformers' window per layer: the attention's attribute (Qwen2/3, Gemma 3,
    SmolLM3) or the config's `sliding_window` on every layer (Mistral, Phi-3; Llama has
    none)."""
    out = []
    for layer in hf.model.layers:
        attn = layer.self_attn
        out.append(
            attn.sliding_window
            if hasattr(attn, "sliding_window")
            else getattr(hf.config, "sliding_window", None)
        )
    return out


def test_loaded_model_structure(model_ckpt: Checkpoint) -> None:
    """Fused weights hold the checkpoint's q/k/v and gate/up rows; ties share storage;
    every layer has transformers' sliding window."""
    m, hf = model_ckpt.model, model_ckpt.hf
    assert m.num_layers == 2 and m.num_kv_heads == 2 and m.head_dim == 16 and m.vocab_size == 128
    attn = m.model.layers[1].self_attn
    hf_attn = hf.model.layers[1].self_attn
    q, kv = attn.q_size, attn.kv_size
    if hasattr(hf_attn, "qkv_proj"):  # Phi-3 stores the fused tensor
        assert torch.equal(attn.qkv_proj.weight, hf_attn.qkv_proj.weight)
    else:
        assert torch.equal(attn.qkv_proj.weight[q : q + kv], hf_attn.k_proj.weight)
        assert torch.equal(attn.qkv_proj.weight[q + kv :], hf_attn.v_proj.weight)
    mlp, hf_mlp = m.model.layers[0].mlp, hf.model.layers[0].mlp
    if hasattr(hf_mlp, "gate_up_proj"):
        assert torch.equal(mlp.gate_up_proj.weight, hf_mlp.gate_up_proj.weight)
    else:
        inter = mlp.intermediate_size
        assert torch.equal(mlp.gate_up_proj.weight[inter:], hf_mlp.up_proj.weight)
    if model_ckpt.config.tie_word_embeddings:
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    else:
        assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
        assert torch.equal(m.lm_head.weight, hf.lm_head.weight)
    has_qkv_bias = model_ckpt.name.startswith(("qwen2", "llama-untied-bias", "qwen3-sliding"))
    assert (attn.qkv_proj.bias is not None) == has_qkv_bias
    has_o_bias = model_ckpt.name.startswith(("llama-untied-bias", "qwen3-sliding"))
    assert (attn.o_proj.bias is not None) == has_o_bias
    windows = _hf_windows(hf)
    assert m.layer_windows == windows
    assert [layer.self_attn.attn.sliding_window for layer in m.model.layers] == windows
    assert m.sliding_window == (None if None in windows else max(windows))
    if model_ckpt.name.endswith("sliding"):
        assert any(windows), "a sliding config must window some layer"


@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_prefill_matches_transformers(model_ckpt: Checkpoint, block_size: int) -> None:
    """(a) Several prompts of different lengths in ONE flattened step: every token's logits."""
    prompts = _prompts(4, [7, 1, 23, 16], vocab=128, seed=3)
    runner = PagedRunner(model_ckpt.model, block_size=block_size)
    out = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)], all_rows=True)
    for prompt, logits in zip(prompts, out, strict=True):
        torch.testing.assert_close(logits, model_ckpt.hf_logits(prompt), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_mixed_with_decodes(model_ckpt: Checkpoint) -> None:
    """(b) A prompt in 3 chunks over 3 steps while other sequences prefill and decode."""
    vocab = 128
    a, b, c = _prompts(3, [37, 9, 12], vocab=vocab, seed=5)
    # Tokens fed after each prompt: arbitrary (not sampled), so every step is checkable
    # against one transformers forward over the sequence's full token list.
    a_more, b_more, c_more = _prompts(3, [3, 6, 4], vocab=vocab, seed=6)
    full = {"a": a + a_more, "b": b + b_more, "c": c + c_more}
    oracle = {s: model_ckpt.hf_logits(toks) for s, toks in full.items()}
    runner = PagedRunner(model_ckpt.model, block_size=4, seed=1)

    steps: list[list[tuple[str, list[int]]]] = [
        [("a", a[:13]), ("b", b)],  # two prefills
        [("b", [b_more[0]]), ("a", a[13:29]), ("c", c)],  # decode + chunk + new prompt
        [("b", [b_more[1]]), ("c", [c_more[0]]), ("a", a[29:])],  # two decodes + last chunk
        [("a", [a_more[0]]), ("b", [b_more[2]]), ("c", [c_more[1]])],
        [("c", [c_more[2]]), ("a", a_more[1:3]), ("b", b_more[3:6])],  # multi-token "chunks"
    ]
    for n, work in enumerate(steps):
        rows = runner.step(work, all_rows=True)
        for (seq, tokens), logits in zip(work, rows, strict=True):
            end = runner.cached[seq]
            want = oracle[seq][end - len(tokens) : end]
            torch.testing.assert_close(
                logits, want, atol=ATOL, rtol=RTOL, msg=lambda m, s=seq, i=n: f"step {i} {s}: {m}"
            )
    # The runner's default (last-token-only) path returns the same rows.
    last = runner.step([("a", [1]), ("b", [2])])
    torch.testing.assert_close(
        last[0], model_ckpt.hf_logits([*full["a"], 1])[-1], atol=ATOL, rtol=RTOL
    )


def test_greedy_decode_matches_generate(model_ckpt: Checkpoint) -> None:
    """(c) 20 greedy steps of 3 sequences decoded together == `generate(do_sample=False)`."""
    prompts = _prompts(3, [5, 18, 11], vocab=128, seed=7)
    runner = PagedRunner(model_ckpt.model, block_size=8, seed=2)
    seqs = [f"g{i}" for i in range(len(prompts))]
    generated: list[list[int]] = [[] for _ in prompts]
    rows = runner.step(list(zip(seqs, prompts, strict=True)))
    for _ in range(20):
        for out, logits in zip(generated, rows, strict=True):
            out.append(int(logits.argmax()))
        rows = runner.step([(s, [g[-1]]) for s, g in zip(seqs, generated, strict=True)])
    for prompt, got in zip(prompts, generated, strict=True):
        with torch.no_grad():
            ref = model_ckpt.hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                pad_token_id=0,
            )
        assert got == ref[0, len(prompt) :].tolist()


def test_bfloat16_load_and_forward_is_close(model_ckpt: Checkpoint) -> None:
    """Loading casts to the serving dtype; bf16 logits stay near the float32 oracle."""
    model, _ = load_model(str(model_ckpt.dir), torch.bfloat16, torch.device("cpu"), progress=_quiet)
    assert isinstance(model, LlamaForCausalLM)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = _prompts(1, [10], vocab=128, seed=9)[0]
    runner = PagedRunner(model, block_size=4)
    (logits,) = runner.step([("x", prompt)])
    assert logits.dtype == torch.float32
    ref = model_ckpt.hf_logits(prompt)[-1]
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_triton_path_matches_transformers(model_ckpt: Checkpoint) -> None:
    """The same mixed prefill/decode steps on CUDA (Triton kernels) against the CPU oracle."""
    a, b = _prompts(2, [29, 6], vocab=128, seed=11)
    oracle = {"a": model_ckpt.hf_logits(a), "b": model_ckpt.hf_logits([*b, 3, 4])}
    steps = [[("a", a[:20]), ("b", b)], [("b", [3]), ("a", a[20:])], [("b", [4])]]
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 0.1)):
        model, _ = load_model(str(model_ckpt.dir), dtype, torch.device("cuda"), progress=_quiet)
        assert isinstance(model, LlamaForCausalLM)
        runner = PagedRunner(model, block_size=16, device="cuda")
        for work in steps:
            for (seq, tokens), logits in zip(work, runner.step(work, all_rows=True), strict=True):
                end = runner.cached[seq]
                want = oracle[seq][end - len(tokens) : end]
                err = (logits - want).abs().max().item()
                assert err <= tol * max(1.0, want.abs().max().item()), (dtype, seq, err)


# ------------------------------------------------------------------------------------
# the real default model
# ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(model_smollm2_dir: str, smollm2_hf_dir: str) -> None:
    """Real SmolLM2 weights: 3 prompts decoded together, token-identical to `generate`."""
    model, config = load_model(model_smollm2_dir, torch.float32, torch.device("cpu"))
    assert isinstance(model, LlamaForCausalLM)
    tok = AutoTokenizer.from_pretrained(model_smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    hf.eval()
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    texts = [chat, "The three primary colors are", "def fibonacci(n):"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    runner = PagedRunner(model, block_size=16, num_blocks=64)
    seqs = [f"p{i}" for i in range(len(prompts))]
    generated: list[list[int]] = [[] for _ in prompts]
    rows = runner.step(list(zip(seqs, prompts, strict=True)))
    live = list(range(len(prompts)))
    for _ in range(30):
        for i, logits in zip(live, rows, strict=True):
            generated[i].append(int(logits.argmax()))
        live = [i for i in live if generated[i][-1] not in eos_ids]
        if not live:
            break
        rows = runner.step([(seqs[i], [generated[i][-1]]) for i in live])

    for prompt, got in zip(prompts, generated, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=30,
                do_sample=False,
            )
        assert got == ref[0, len(prompt) :].tolist(), tok.decode(got)
    answer = tok.decode(generated[0], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_sliding_window_is_what_matches(model_ckpt: Checkpoint) -> None:
    """The windowed configs' prompts run past the window, and the window matters: with
    it lifted, the logits no longer match transformers."""
    if not any(model_ckpt.model.layer_windows) or model_ckpt.model.layer_windows == [4096] * 2:
        pytest.skip("no short window in this config")
    prompt = _prompts(1, [23], vocab=128, seed=3)[0]
    assert len(prompt) > max(w for w in model_ckpt.model.layer_windows if w)
    attns = [layer.self_attn.attn for layer in model_ckpt.model.model.layers]
    with windows_lifted(attns):
        (lifted,) = PagedRunner(model_ckpt.model, block_size=4).step([("x", prompt)], all_rows=True)
    assert not torch.allclose(lifted, model_ckpt.hf_logits(prompt), atol=ATOL, rtol=RTOL)


def test_longrope_tables_and_decoding_up_to_the_switch(tmp_path: Path) -> None:
    """Phi-3 LongRoPE: row p of the cos/sin table is transformers' rotary at position p
    alone (short factors below original_max_position_embeddings, long ones from there,
    both scaled by the attention factor), and greedy decoding is token-identical up to
    the switch.

    Past it the two differ by design: when a sequence grows past the original length,
    transformers' `generate` re-encodes the *whole* sequence with the long factors (the
    cached keys are dropped), while a paged cache keeps the keys it has, rotated with the
    short ones (docs/models.md, "LongRoPE")."""
    ckpt = Checkpoint("phi3-longrope", tmp_path)
    original = ckpt.config.rope_parameters["original_max_position_embeddings"]
    rotary = ckpt.hf.model.rotary_emb
    table = ckpt.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    half = table.shape[1] // 2
    for pos in (0, 5, original - 1, original, original + 7, 200):
        cos, sin = rotary(torch.zeros(1, 1, 16), torch.tensor([[pos]]))
        assert torch.equal(table[pos, :half], cos[0, 0, :half]), pos
        assert torch.equal(table[pos, half:], sin[0, 0, :half]), pos
    assert not torch.equal(table[original - 1], table[original])

    prompt = _prompts(1, [original - 10], vocab=128, seed=21)[0]
    runner = PagedRunner(ckpt.model, block_size=8, seed=4)
    got: list[int] = []
    (logits,) = runner.step([("p", prompt)])
    before_switch = original - len(prompt) + 1  # tokens sampled from positions < original
    for _ in range(before_switch):
        got.append(int(logits.argmax()))
        (logits,) = runner.step([("p", [got[-1]])])
    with torch.no_grad():
        ref = ckpt.hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=before_switch, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    assert got == ref[0, len(prompt) :].tolist()
