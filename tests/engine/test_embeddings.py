"""Embedding requests through the whole engine (scheduler, paged cache, chunked prefill,
preemption, batching with generation) on tiny random-weight causal LMs, against
sentence-transformers' own `encode` (mean, CLS and last-token pooling, Normalize,
Matryoshka truncation) and transformers' `last_hidden_state` (the default last-token
pooling of a model without a sentence-transformers config), in float32.

The checkpoints are built here: a byte-level BPE tokenizer trained in a few ms
(tests/handlers/handlers_testing.py), a LlamaConfig with random weights saved with
`save_pretrained`, and the sentence-transformers files (modules.json, 1_Pooling,
2_Normalize) written beside them, as sentence-transformers itself saves them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.messages import AddRequest, PoolingParams, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.handlers.handlers_testing import build_tiny_model

TOL = 1e-5
"""Largest |hearth - reference| per component of a unit-norm embedding (float32; chunked
sums and a different matmul order account for ~1e-7)."""
HIDDEN = 64
MAX_MODEL_LEN = 256

TEXTS = [
    "The capital of France is Paris.",
    "Hello world!",
    "Emoji are fun 😀🎉 and so is 你好世界 in Chinese.",
    "Numbers like 12345 and words like banana, apple, cherry.",
    "a",
    " ".join(["You are a helpful assistant. Answer briefly and politely."] * 4),
]


def _quiet(_: str) -> None:
    """Progress sink: keep test output clean."""


def build_checkpoint(directory: Path) -> Path:
    """Tokenizer + random-weight LlamaForCausalLM (no pooling config: last-token)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    build_tiny_model(directory)
    vocab = Tokenizer(directory).vocab_size
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.save_pretrained(directory)
    return directory


def add_sentence_transformers(
    base: Path, directory: Path, mode: Any, *, normalize: bool = True, **config: Any
) -> Path:
    """A copy of `base` with a sentence-transformers pipeline: Transformer -> Pooling
    (`mode`) [-> Normalize]; `config` goes into config.json (Matryoshka keys)."""
    shutil.copytree(base, directory)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": HIDDEN, "pooling_mode": mode, "include_prompt": True})
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (directory / "2_Normalize").mkdir()
    (directory / "modules.json").write_text(json.dumps(modules))
    if config:
        hf_config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**hf_config, **config}))
    return directory


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("embed") / "causal-lm")


def make_core(model_dir: Path, **overrides: Any):
    from engine.core import EngineCore

    overrides.setdefault("max_num_seqs", 16)
    config = EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, **overrides)
    return EngineCore(config, progress=_quiet)


def as_vector(out: RequestOutput) -> torch.Tensor:
    assert out.embedding is not None and out.finish_reason == "stop"
    return torch.from_numpy(np.frombuffer(out.embedding, dtype="<f4").copy())


def embed(
    core,
    prompts: list[list[int]],
    tag: str,
    dimensions: int | None = None,
    normalize: bool | None = None,
) -> list[torch.Tensor]:
    """Admit every prompt at once as an embedding request; run to the end."""
    pooling = PoolingParams(dimensions=dimensions, normalize=normalize)
    outs = run(core, [(f"{tag}-{i}", ids, None, pooling) for i, ids in enumerate(prompts)])
    return [as_vector(outs[f"{tag}-{i}"][-1]) for i in range(len(prompts))]


def run(
    core, work: list[tuple[str, list[int], SamplingParams | None, PoolingParams | None]]
) -> dict[str, list[RequestOutput]]:
    """Admit `(id, prompt, params or None for an embedding, its pooling)` all at once and
    step until idle; every output per request. Asserts no KV block is left in use."""
    for rid, ids, params, pooling in work:
        msg = AddRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params or SamplingParams(),
            pooling=None if params is not None else pooling or PoolingParams(),
        )
        admission = core.add_request(msg)
        assert admission is not None and admission.accepted, admission
    outs: dict[str, list[RequestOutput]] = {}
    while core.has_work():
        for _, out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    assert core.block_manager.num_used_blocks == 0
    return outs


def encode_all(model_dir: Path) -> list[list[int]]:
    tok = Tokenizer(model_dir)
    return [tok.encode(text, add_special_tokens=True) for text in TEXTS]


def st_encode(model_dir: Path, **kwargs: Any) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS), **kwargs).float()


def assert_close(got: list[torch.Tensor], expected: torch.Tensor) -> float:
    stacked = torch.stack(got)
    assert stacked.shape == expected.shape
    worst = float((stacked - expected).abs().max())
    assert worst <= TOL, worst
    return worst


# -- exact against the references ------------------------------------------------------
@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
def test_pooling_matches_sentence_transformers(base_dir: Path, tmp_path: Path, mode: str) -> None:
    model_dir = add_sentence_transformers(base_dir, tmp_path / mode, mode)
    core = make_core(model_dir)
    assert core.pooling.method == {"lasttoken": "last"}.get(mode, mode)
    got = embed(core, encode_all(model_dir), mode)
    expected = st_encode(model_dir)
    worst = assert_close(got, expected)
    assert all(abs(float(v.norm()) - 1.0) < 1e-6 for v in got)
    print(f"\n{mode}: max |hearth - sentence-transformers| = {worst:.2e}")


def test_without_normalize_the_vector_is_the_raw_mean(base_dir: Path, tmp_path: Path) -> None:
    model_dir = add_sentence_transformers(base_dir, tmp_path / "raw", "mean", normalize=False)
    got = embed(make_core(model_dir), encode_all(model_dir), "raw")
    expected = st_encode(model_dir)
    assert_close(got, expected)
    assert any(abs(float(v.norm()) - 1.0) > 1e-2 for v in got)


def test_causal_lm_without_config_pools_the_last_token(base_dir: Path) -> None:
    """The documented default: transformers' last_hidden_state at the last prompt token
    (final norm applied), L2-normalised."""
    from transformers import AutoModel

    core = make_core(base_dir)
    assert (core.pooling.method, core.pooling.normalize) == ("last", True)
    prompts = encode_all(base_dir)
    got = embed(core, prompts, "default")
    hf = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.stack(
            [
                torch.nn.functional.normalize(
                    hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1
                )
                for ids in prompts
            ]
        )
    assert_close(got, expected)


def test_the_request_overrides_normalisation(base_dir: Path, tmp_path: Path) -> None:
    """vLLM's use_activation: false gives a normalising model's raw vector, true
    normalises a model that does not."""
    from transformers import AutoModel

    prompts = encode_all(base_dir)
    raw = embed(make_core(base_dir), prompts, "raw", normalize=False)
    hf = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.stack(
            [hf(torch.tensor([ids])).last_hidden_state[0, -1] for ids in prompts]
        )
    assert_close(raw, expected)
    assert any(abs(float(v.norm()) - 1.0) > 1e-2 for v in raw)
    model_dir = add_sentence_transformers(base_dir, tmp_path / "unit", "mean", normalize=False)
    unit = embed(make_core(model_dir), encode_all(model_dir), "unit", normalize=True)
    assert_close(unit, st_encode(model_dir, normalize_embeddings=True))


def test_matryoshka_dimensions_match_truncate_dim(base_dir: Path, tmp_path: Path) -> None:
    model_dir = add_sentence_transformers(base_dir, tmp_path / "mrl", "mean", is_matryoshka=True)
    core = make_core(model_dir)
    got = embed(core, encode_all(model_dir), "mrl", dimensions=16)
    assert all(v.shape == (16,) for v in got)
    assert_close(got, st_encode(model_dir, truncate_dim=16, normalize_embeddings=True))


# -- batching, chunking, preemption, the prefix cache --------------------------------------
@pytest.fixture(scope="module")
def mean_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_sentence_transformers(base_dir, tmp_path_factory.mktemp("mean") / "m", "mean")


def test_chunked_prefill_pools_across_chunks(mean_dir: Path) -> None:
    prompts = encode_all(mean_dir)
    assert max(len(p) for p in prompts) > 3 * 16
    core = make_core(mean_dir, max_num_batched_tokens=16)
    assert_close(embed(core, prompts, "chunked"), st_encode(mean_dir))


def test_preempted_embedding_is_pooled_once(mean_dir: Path) -> None:
    prompts = encode_all(mean_dir)
    long_ids = prompts[-1]
    core = make_core(mean_dir, max_num_batched_tokens=16)
    core.add_request(
        AddRequest(
            request_id="p",
            prompt_token_ids=long_ids,
            params=SamplingParams(),
            pooling=PoolingParams(),
        )
    )
    core.step()
    core.step()
    request = core.scheduler.requests["p"]
    assert 0 < request.num_computed_tokens < len(long_ids)
    core.scheduler.preempt(request)  # what running out of blocks does: recompute from 0
    outs = []
    while core.has_work():
        outs += [o for _, o in core.step()]
    assert [o.request_id for o in outs] == ["p"]
    assert_close([as_vector(outs[0])], st_encode(mean_dir)[-1:])


def test_mixed_with_generation_changes_no_token(mean_dir: Path) -> None:
    """Embedding requests in the same steps as greedy generation: the generated tokens
    are identical to generation alone, and the embeddings equal sentence-transformers."""
    prompts = encode_all(mean_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core = make_core(mean_dir, max_num_batched_tokens=32)
    alone = run(core, [(f"g{i}", ids, greedy, None) for i, ids in enumerate(prompts[:3])])
    mixed_work = []
    for i, ids in enumerate(prompts):
        if i < 3:
            mixed_work.append((f"mg{i}", ids, greedy, None))
        mixed_work.append((f"me{i}", ids, None, None))
    kinds_per_step: list[set[bool]] = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        kinds_per_step.append({item.request.pooling is None for item in out.scheduled})
        return out

    core.scheduler.schedule = recording_schedule
    mixed = run(core, mixed_work)
    assert {True, False} in kinds_per_step  # a step ran both kinds together
    for i in range(3):
        tokens_alone = [t for o in alone[f"g{i}"] for t in o.new_token_ids]
        tokens_mixed = [t for o in mixed[f"mg{i}"] for t in o.new_token_ids]
        assert len(tokens_alone) == 12
        assert tokens_mixed == tokens_alone
    got = [as_vector(mixed[f"me{i}"][-1]) for i in range(len(prompts))]
    assert_close(got, st_encode(mean_dir))
    # One output per embedding request, no tokens, usage counted.
    for i, ids in enumerate(prompts):
        (out,) = mixed[f"me{i}"]
        assert out.new_token_ids == [] and out.num_prompt_tokens == len(ids)


def test_embeddings_neither_use_nor_fill_the_prefix_cache(mean_dir: Path) -> None:
    prompts = encode_all(mean_dir)
    core = make_core(mean_dir, block_size=4)
    bm = core.block_manager
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    shared = prompts[-1]
    # An embedding of a prompt puts nothing in the prefix cache...
    embed(core, [shared], "first")
    (out,) = run(core, [("after-embed", shared, plain, None)])["after-embed"]
    assert out.num_cached_tokens == 0
    # ...a generation request does, and a later embedding does not read it.
    (out,) = run(core, [("again", shared, plain, None)])["again"]
    assert out.num_cached_tokens > 0
    queries_before = bm.num_prefix_queries
    assert_close(embed(core, [shared], "second"), st_encode(mean_dir)[-1:])
    assert bm.num_prefix_queries == queries_before


def test_prompt_tokens_are_counted(mean_dir: Path) -> None:
    prompts = encode_all(mean_dir)
    core = make_core(mean_dir)
    before = core.num_prompt_tokens_total, core.num_generation_tokens_total
    computed = core.num_prefill_tokens_computed
    embed(core, prompts, "usage")
    assert core.num_prompt_tokens_total - before[0] == sum(len(p) for p in prompts)
    assert core.num_prefill_tokens_computed - computed == sum(len(p) for p in prompts)
    assert core.num_generation_tokens_total == before[1]
    # Generation: decode steps add nothing, and a second run's prefix-cache hit is not
    # computed again.
    long = prompts[-1] * 3
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    computed = core.num_prefill_tokens_computed
    run(core, [("first", long, plain, None)])
    assert core.num_prefill_tokens_computed - computed == len(long)
    computed = core.num_prefill_tokens_computed
    (out,) = run(core, [("second", long, plain, None)])["second"][-1:]
    assert out.num_cached_tokens > 0
    assert core.num_prefill_tokens_computed - computed == len(long) - out.num_cached_tokens


# -- admission ---------------------------------------------------------------------------
def test_admission_rules(base_dir: Path, tmp_path: Path) -> None:
    core = make_core(base_dir)
    vocab = core.vocab_size

    def admit(rid: str, ids: list[int], dimensions: int | None = None):
        msg = AddRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=SamplingParams(),
            pooling=PoolingParams(dimensions=dimensions),
        )
        return core.add_request(msg)

    # A prompt may fill the whole context: nothing is generated after it.
    assert admit("full", [5] * MAX_MODEL_LEN).accepted
    too_long = admit("long", [5] * (MAX_MODEL_LEN + 1))
    assert not too_long.accepted and "maximum context length" in too_long.message
    out_of_vocab = admit("oov", [1, vocab])
    assert not out_of_vocab.accepted and "token ids" in out_of_vocab.message
    no_mrl = admit("dims", [1, 2], dimensions=8)
    assert not no_mrl.accepted and "Matryoshka" in no_mrl.message
    while core.has_work():
        core.step()
    assert core.block_manager.num_used_blocks == 0

    listed = add_sentence_transformers(
        base_dir, tmp_path / "listed", "mean", matryoshka_dimensions=[16, 32]
    )
    core = make_core(listed)
    assert admit("ok", [1, 2], dimensions=32).accepted
    wrong = admit("wrong", [1, 2], dimensions=8)
    assert not wrong.accepted and "[16, 32]" in wrong.message


def test_last_token_embeddings_use_and_fill_the_prefix_cache(base_dir: Path) -> None:
    """Last-token pooling reads one position, which a cache hit never covers: such an
    embedding starts after the cached blocks of an earlier request with its prefix (an
    embedding's or a generation's) and leaves its own blocks for later ones, with the
    same vector (transformers' within TOL) as when it computed every position."""
    from transformers import AutoModel

    core = make_core(base_dir)
    bm = core.block_manager
    prompt = (encode_all(base_dir)[-1] * 4)[:70]
    assert len(prompt) > 2 * bm.block_size
    first = embed(core, [prompt], "cold")[0]
    hits = bm.num_prefix_hits
    again = embed(core, [prompt], "warm")[0]
    assert bm.num_prefix_hits - hits >= 2 * bm.block_size
    hf = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.nn.functional.normalize(
            hf(torch.tensor([prompt])).last_hidden_state[0, -1], dim=-1
        )
    assert_close([first, again], torch.stack([expected, expected]))
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (out,) = run(core, [("after", [*prompt, 5, 6], plain, None)])["after"][-1:]
    assert out.num_cached_tokens >= 2 * bm.block_size


def test_an_embedding_in_a_session_is_checked_against_it_and_pins_nothing(
    base_dir: Path,
) -> None:
    """SageMaker's session header on a pooling body: an unknown session is refused as a
    generation's is (the route's 400), a live one admits the embedding, which then pins
    no block to it (its prompt leaves no conversation to keep warm); the same prompt as
    a generation in that session pins its full blocks."""
    from engine.core import SESSION_GONE

    core = make_core(base_dir)
    bm = core.block_manager
    prompt = (encode_all(base_dir)[-1] * 4)[:70]

    def pooled(rid: str, session_id: str):
        return core.add_request(
            AddRequest(
                request_id=rid, prompt_token_ids=prompt, params=SamplingParams(),
                pooling=PoolingParams(), session_id=session_id,
            )
        )  # fmt: skip

    gone = pooled("guessed", "a" * 32)
    assert gone is not None and not gone.accepted and gone.message == SESSION_GONE
    session_id, _ = core.sessions.open(ttl_s=60)
    admission = pooled("pooled", session_id)
    assert admission is not None and admission.accepted, admission
    while core.has_work():
        core.step()
    assert bm.num_pinned_blocks == 0
    turn = AddRequest(
        request_id="turn",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=1, temperature=0.0),
        session_id=session_id,
    )
    assert core.add_request(turn).accepted
    while core.has_work():
        core.step()
    assert bm.num_pinned_blocks == len(prompt) // bm.block_size


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("grouped", [True, False])
def test_a_many_input_request_takes_turns_with_a_later_chat(
    base_dir: Path, grouped: bool, policy: str
) -> None:
    """One API request of 10 embedding inputs (~200 tokens each, one group), then a
    generation request of the same priority: with groups the generation is admitted after
    the first input's turn and finishes while most inputs still wait; as ten unrelated
    requests (strict order, the control) it starts only after every input. Under both
    scheduling policies."""
    core = make_core(base_dir, max_num_batched_tokens=64, max_num_seqs=2, scheduling_policy=policy)
    inputs = [[(7 * i + j) % 200 + 3 for j in range(200)] for i in range(10)]
    for i, ids in enumerate(inputs):
        admission = core.add_request(
            AddRequest(
                request_id=f"emb-{i}",
                prompt_token_ids=ids,
                params=SamplingParams(),
                pooling=PoolingParams(),
                group="emb" if grouped else None,
            )
        )
        assert admission is not None and admission.accepted
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    admission = core.add_request(
        AddRequest(request_id="chat", prompt_token_ids=list(range(3, 40)), params=greedy)
    )
    assert admission is not None and admission.accepted
    finished: list[str] = []
    while core.has_work():
        finished += [out.request_id for _, out in core.step() if out.finish_reason]
    assert sorted(finished) == sorted([f"emb-{i}" for i in range(10)] + ["chat"])
    assert core.block_manager.num_used_blocks == 0
    if grouped:
        assert finished.index("chat") <= 2
    else:
        assert finished.index("chat") == 10
