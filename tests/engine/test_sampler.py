"""Batched sampling on synthetic logits: each parameter changes the result the way it
should, whole batches mix parameters, and seeds reproduce."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB = 32
EOS = [0]


def _req(
    rid: str = "r",
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    **params: object,
) -> Request:
    r = Request(rid, prompt or [5, 6, 7], SamplingParams(**params))  # type: ignore[arg-type]
    r.all_token_ids.extend(output or [])
    return r


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_greedy_is_argmax_for_every_row() -> None:
    logits = _logits(4)
    out = Sampler(torch.device("cpu"))(
        logits, [_req(f"r{i}", temperature=0) for i in range(4)], EOS
    )
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs is None


def test_greedy_takes_the_first_of_tied_maxima_and_nan_as_argmax_does() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[0, [7, 3, 11]] = 5.0  # tie: the lowest index wins
    logits[1, 9], logits[1, 4] = float("nan"), 100.0  # NaN counts as the largest
    logits[2] = float("-inf")  # all -inf: index 0
    logits[3, [VOCAB - 1, VOCAB - 2]] = 1.0
    out = Sampler(torch.device("cpu"))(
        logits, [_req(f"r{i}", temperature=0) for i in range(4)], EOS
    )
    assert out.token_ids == [3, 9, 0, VOCAB - 2] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 17, 100, 49153])
def test_c_argmax_is_torchs_max_indices_on_hard_rows(vocab: int) -> None:
    """The C greedy kernel (eight lanes, then a scalar tail) gives torch's index on rows of
    every width against its lanes (under 8, exactly 8, a tail of 1): random rows, rows all
    tied, all -inf, many ties from rounding, a maximum tied at both ends of the row, +inf
    beside NaN, NaN first, last and in the middle; alone or in a batch, the same index."""
    ops = pytest.importorskip("kernels.cpu.ops")
    if not ops.available():
        pytest.skip("the C kernels do not run on this host (no AVX2)")
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(10, vocab, generator=gen)
    rows[1] = 1.0
    rows[2] = float("-inf")
    rows[3] = (torch.randn(vocab, generator=gen) * 2).round()
    rows[4, 0] = rows[4, -1] = 100.0
    rows[5, vocab // 2] = float("inf")
    rows[5, -1] = float("nan")
    rows[6, 0] = float("nan")
    rows[7, vocab // 2] = float("nan")
    rows[8, -1] = float("nan")
    want = rows.max(dim=-1).indices
    assert torch.equal(ops.argmax(rows), want)
    for i in range(rows.shape[0]):
        assert torch.equal(ops.argmax(rows[i : i + 1]), want[i : i + 1])
    with pytest.raises(ValueError, match="argmax"):
        ops.argmax(torch.empty(2, 0))


def test_top_k_1_and_tiny_top_p_reduce_to_greedy() -> None:
    logits = _logits(3)
    reqs = [
        _req("a", temperature=1.5, top_k=1),
        _req("b", temperature=1.5, top_p=1e-6),
        _req("c", temperature=1.5, min_p=0.999),
    ]
    for _ in range(20):
        out = Sampler(torch.device("cpu"))(logits, reqs, EOS)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_limits_choices_to_the_k_best() -> None:
    logits = _logits(1)
    best3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(torch.device("cpu"))
    seen = {sampler(logits, [_req(temperature=5.0, top_k=3)], EOS).token_ids[0] for _ in range(300)}
    assert seen == best3


def test_top_p_keeps_the_smallest_set_covering_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sampler = Sampler(torch.device("cpu"))
    seen = {
        sampler(logits, [_req(temperature=1.0, top_p=0.7)], EOS).token_ids[0] for _ in range(300)
    }
    assert seen == {0, 1}


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1] + [1e-12] * (VOCAB - 3)]))
    sampler = Sampler(torch.device("cpu"))
    rows = 4000
    batch = logits.expand(rows, VOCAB).contiguous()
    ids = sampler(batch, [_req(f"r{i}", temperature=1.0) for i in range(rows)], EOS).token_ids
    freq = [ids.count(t) / rows for t in range(3)]
    for got, want in zip(freq, [0.6, 0.3, 0.1], strict=True):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / rows)


def test_seed_reproduces_and_differs_across_seeds() -> None:
    logits = _logits(1).expand(1, VOCAB)

    def draw(seed: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"))
        req = _req("s", temperature=2.0, seed=seed)
        return [sampler(logits, [req], EOS).token_ids[0] for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = _logits(2)
    best = logits.argmax(-1).tolist()
    reqs = [
        _req("a", temperature=0, logit_bias={best[0]: -100.0}),
        _req("b", temperature=0, logit_bias={3: 100.0}),
    ]
    out = Sampler(torch.device("cpu"))(logits, reqs, EOS)
    assert out.token_ids[0] != best[0] and out.token_ids[1] == 3


def test_allowed_token_ids_are_the_only_choices() -> None:
    """vLLM's allowed_token_ids: greedy takes the best allowed token, sampling never
    leaves the set (even against a bias for another token), logprobs are of the masked
    distribution, and a row without the field in the same batch is untouched."""
    logits = _logits(3)
    allowed = [4, 9, 17]
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    sampler = Sampler(torch.device("cpu"))
    reqs = [
        _req("g", temperature=0, allowed_token_ids=allowed, logprobs=2),
        _req("s", temperature=1.0, seed=3, allowed_token_ids=allowed, logit_bias={5: 100.0}),
        _req("free", temperature=0),
    ]
    for _ in range(50):
        out = sampler(logits, reqs, EOS)
        assert out.token_ids[0] == best_allowed
        assert out.token_ids[1] in allowed
        assert out.token_ids[2] == logits[2].argmax().item()
    entry = out.logprobs[0]
    assert {t for t, _ in entry.top} <= set(allowed)
    expected = torch.log_softmax(logits[0, allowed], -1).max().item()
    assert entry.logprob == pytest.approx(expected, abs=1e-6)


def test_bad_words_ban_a_sequence_s_last_token_after_its_prefix() -> None:
    """vLLM's bad words: a one-token word is never sampled; a longer one's last token is
    banned only right after its other tokens were generated; other rows untouched."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # the greedy choice everywhere
    logits[:, 8] = 4.0
    sampler = Sampler(torch.device("cpu"))
    single = _req("single", temperature=0, bad_words_token_ids=[[7]])
    after_prefix = _req("after", output=[3, 1, 2], temperature=0, bad_words_token_ids=[[1, 2, 7]])
    other_prefix = _req("other", output=[3, 2, 2], temperature=0, bad_words_token_ids=[[1, 2, 7]])
    out = sampler(logits, [single, after_prefix, other_prefix], EOS)
    assert out.token_ids == [8, 8, 7]
    # Too short an output for the prefix: nothing banned.
    short = _req("short", output=[2], temperature=0, bad_words_token_ids=[[1, 2, 7]])
    assert sampler(logits[:1], [short], EOS).token_ids == [7]
    # Sampled rows never draw a banned token either.
    hot = _req("hot", temperature=1.0, seed=1, bad_words_token_ids=[[7], [8]])
    for _ in range(50):
        assert sampler(logits[:1], [hot], EOS).token_ids[0] not in (7, 8)


def test_bad_words_give_way_when_nothing_else_is_allowed() -> None:
    logits = _logits(1)
    sampler = Sampler(torch.device("cpu"))
    req = _req("r", temperature=0, allowed_token_ids=[4, 9], bad_words_token_ids=[[4], [9]])
    assert sampler(logits, [req], EOS).token_ids[0] in (4, 9)
    some = _req("s", temperature=0, allowed_token_ids=[4, 9], bad_words_token_ids=[[4]])
    assert sampler(logits, [some], EOS).token_ids == [9]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # EOS is the greedy choice
    logits[0, 9] = 9.0  # then a stop token
    logits[0, 1] = 8.0  # then an ordinary token
    sampler = Sampler(torch.device("cpu"))
    early = _req("a", output=[4], temperature=0, min_tokens=3, stop_token_ids=[9])
    assert sampler(logits, [early], EOS).token_ids == [1]
    done = _req("b", output=[4, 4, 4], temperature=0, min_tokens=3, stop_token_ids=[9])
    assert sampler(logits, [done], EOS).token_ids == [0]


def test_penalties_push_away_repeated_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    logits[0, 5] = 0.9
    sampler = Sampler(torch.device("cpu"))
    plain = _req("a", output=[4, 4, 4], prompt=[10, 11], temperature=0)
    assert sampler(logits, [plain], EOS).token_ids == [4]
    for params in (
        {"frequency_penalty": 0.1},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.5},
    ):
        req = _req("b", output=[4, 4, 4], prompt=[10, 11], temperature=0, **params)
        assert sampler(logits, [req], EOS).token_ids == [5], params


def test_logprobs_match_log_softmax_with_ranks_and_top_k() -> None:
    logits = _logits(2)
    reqs = [_req("a", temperature=0, logprobs=3), _req("b", temperature=0)]
    out = Sampler(torch.device("cpu"))(logits, reqs, EOS)
    assert out.logprobs is not None and out.logprobs[1] is None
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == out.token_ids[0] and lp.rank == 1
    assert lp.logprob == pytest.approx(ref.max().item(), abs=1e-5)
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-5)


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = _logits(6)
    reqs = [_req(f"r{i}", temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(6)]
    for _ in range(10):
        ids = Sampler(torch.device("cpu"))(logits, reqs, EOS).token_ids
        assert [ids[i] for i in (0, 2, 4)] == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_values_at_the_edge_of_float32_stay_sane() -> None:
    logits = _logits(3)
    reqs = [
        _req("a", temperature=1e-40),
        _req("b", temperature=1.0, top_p=1e-320),
        _req("c", temperature=0, output=[1, 2], repetition_penalty=1e-320),
    ]
    out = Sampler(torch.device("cpu"))(logits, reqs, EOS)
    greedy = logits.argmax(-1).tolist()
    assert out.token_ids[:2] == greedy[:2]
    assert 0 <= out.token_ids[2] < VOCAB


def test_logprob_token_ids_are_reported_in_their_order() -> None:
    """vLLM's logprob_token_ids: those ids' logprobs, in the order asked, stand in for
    the top k (the sampled token's logprob and rank stay); other rows keep their top k."""
    logits = _logits(2)
    sampler = Sampler(torch.device("cpu"))
    named = [17, 3, 3, 0]
    reqs = [
        _req("named", temperature=0, logprobs=len(named), logprob_token_ids=named),
        _req("top", temperature=0, logprobs=2),
    ]
    out = sampler(logits, reqs, EOS)
    full = torch.log_softmax(logits, -1)
    first, second = out.logprobs
    assert [t for t, _ in first.top] == named
    assert [lp for _, lp in first.top] == pytest.approx(full[0, named].tolist(), abs=1e-6)
    assert first.token_id == logits[0].argmax().item() and first.rank == 1
    assert [t for t, _ in second.top] == full[1].topk(2).indices.tolist()


# -- the inverse-CDF draw across blocks (Sampler._inverse_cdf) ---------------------------


@pytest.mark.parametrize("vocab", [1000, 768, 100])
def test_random_draws_follow_the_distribution_across_blocks(vocab: int) -> None:
    """Tokens at block edges (255/256, 511/512), in the short last block and alone in a
    block, with zero-probability tokens between them: 40,000 draws match the softmax
    (each listed token, and the rest pooled, within 5 binomial sigmas) and never a zero
    one."""
    torch.manual_seed(0)
    probs = torch.zeros(vocab)
    named = [i for i in (0, 255, 256, 511, 512, 700, vocab - 1) if i < vocab]
    weights = torch.tensor([0.3, 0.05, 0.2, 0.1, 0.15, 0.05, 0.1][: len(named)])
    probs[named] = weights / weights.sum() * 0.9
    rest = [i for i in range(vocab) if i not in named and i % 3 == 0]  # others stay 0
    probs[rest] = 0.1 / len(rest)
    logits = probs.log()  # log(0) = -inf: never drawn
    rows = 40_000
    batch = logits.expand(rows, vocab).contiguous()
    reqs = [_req(f"r{i}", temperature=1.0) for i in range(rows)]
    ids = Sampler(torch.device("cpu"))(batch, reqs, EOS).token_ids
    counts = torch.bincount(torch.tensor(ids), minlength=vocab)
    assert int(counts[probs == 0].sum()) == 0
    observed = [int(counts[i]) for i in named] + [int(counts[rest].sum())]
    chances = [float(probs[i]) for i in named] + [float(probs[rest].sum())]
    for got, p in zip(observed, chances, strict=True):
        assert abs(got - p * rows) < 5 * math.sqrt(rows * p * (1 - p)), (got, p * rows)


def test_a_seeded_row_draws_the_same_tokens_in_any_batch() -> None:
    logits = _logits(4)

    def draws(batch_rows: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"))
        seeded = _req("seeded", temperature=1.0, seed=11)
        others = [_req(f"o{i}", temperature=1.0) for i in range(batch_rows - 1)]
        rows = logits[:batch_rows]
        return [sampler(rows, [seeded, *others], EOS).token_ids[0] for _ in range(40)]

    assert draws(1) == draws(4)


def test_a_row_of_nan_logits_falls_back_to_argmax() -> None:
    logits = _logits(3)
    logits[1] = float("nan")
    reqs = [_req(f"r{i}", temperature=1.0) for i in range(3)]
    out = Sampler(torch.device("cpu"))(logits, reqs, EOS).token_ids
    assert out[1] == int(logits[1].argmax())
    assert all(0 <= t < VOCAB for t in out)


def _transformers_distribution(logits: torch.Tensor, **params: float) -> torch.Tensor:
    """The distribution transformers' own warpers leave (temperature, top-k, top-p, then
    min-p: hearth's order), as probabilities."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.unsqueeze(0).clone()
    scores = TemperatureLogitsWarper(params["temperature"])(None, scores)
    if params.get("top_k"):
        scores = TopKLogitsWarper(int(params["top_k"]))(None, scores)
    if params.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(params["top_p"])(None, scores)
    if params.get("min_p"):
        scores = MinPLogitsWarper(params["min_p"])(None, scores)
    return scores.softmax(dim=-1).squeeze(0)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8, "top_k": 50, "top_p": 0.8},  # drawn from the top-k columns
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 0.9, "top_p": 0.7},  # the cut within the first 64 candidates
        {"temperature": 3.0, "top_p": 0.95},  # mass spread wide: 1024 candidates, or the sort
        {"temperature": 1.0, "min_p": 0.05},
    ],
    ids=["top_k+top_p", "top_k", "top_p", "top_p-wide", "min_p"],
)
def test_sampling_matches_transformers_warpers(params: dict[str, float]) -> None:
    """20,000 draws of one row's distribution under each filter: every token transformers'
    warpers remove is never drawn, and each token's share (those above 1 %, and all
    the others pooled) is within 5 binomial sigmas of transformers' probability."""
    vocab, rows = 3000, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 2.5
    want = _transformers_distribution(logits, **params)
    batch = logits.expand(rows, vocab).contiguous()
    reqs = [_req(f"r{i}", **params) for i in range(rows)]
    ids = Sampler(torch.device("cpu"))(batch, reqs, EOS).token_ids
    counts = torch.bincount(torch.tensor(ids), minlength=vocab)
    assert int(counts[want == 0].sum()) == 0
    big = (want > 0.01).nonzero().flatten().tolist()
    small = (want > 0) & (want <= 0.01)
    pairs = [(int(counts[i]), float(want[i])) for i in big]
    # a pooled share of every token (a flat row: none above 1 %) can sum past 1 by float32
    # rounding (AVX-512 hosts' softmax): a share is at most 1
    pairs.append((int(counts[small].sum()), min(float(want[small].sum()), 1.0)))
    for got, p in pairs:
        assert abs(got - p * rows) <= 5 * math.sqrt(rows * p * (1 - p)) + 1, (got, p * rows)


def test_a_batch_mixing_top_k_with_unfiltered_and_greedy_rows() -> None:
    """Rows without top_k take the full-vocabulary path, greedy rows stay argmax, and a
    top_k row only ever draws among its k best (a batch that cannot use the top-k
    columns alone)."""
    logits = _logits(3)
    sampler = Sampler(torch.device("cpu"))
    reqs = [
        _req("k", temperature=1.0, top_k=3),
        _req("all", temperature=1.0),
        _req("g", temperature=0.0),
    ]
    best3 = set(logits[0].topk(3).indices.tolist())
    for _ in range(50):
        ids = sampler(logits, reqs, EOS).token_ids
        assert ids[0] in best3 and ids[2] == int(logits[2].argmax())


def _kernel_path(kernel: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the sampler's `kernel` (top_p, min_p) take `path`: the C kernel (skips where it
    cannot run) or torch."""
    from engine import sampler

    if path == "torch":
        native = sampler._native
        monkeypatch.setattr(sampler, "_native", lambda k: None if k == kernel else native(k))
        return
    from kernels.cpu import ops

    if not ops.available():
        pytest.skip("the C kernels do not run on this host (no AVX2)")
    assert sampler._native(kernel) is getattr(ops, kernel)


def _top_p_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_path("top_p", path, monkeypatch)


@pytest.mark.parametrize("path", ["c", "torch"])
def test_min_p_masks_what_torchs_ops_mask_bit_for_bit(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apply_min_p` (the C kernel or torch's ops) gives the bits of the plain method
    (``masked_fill(probs < max * min_p, 0)``) on rows of every width against the kernel's
    eight lanes: a threshold that lands exactly on a probability (kept), min_p 0 and 1,
    ties at the top, a row of zeros, NaN first / inside / last (the row is left as it
    is), +inf (everything else cut), negative zeros; alone and batched."""
    from engine.sampler import apply_min_p

    _kernel_path("min_p", path, monkeypatch)
    for vocab in (1, 7, 8, 9, 17, 3001):
        gen = torch.Generator().manual_seed(vocab)
        rows = (torch.randn(11, vocab, generator=gen) * 2).softmax(dim=-1)
        rows[1] = (torch.randn(vocab, generator=gen) * 4).round().abs() / 8
        rows[2] = 0.0
        rows[3, 0] = float("nan")
        rows[4, vocab // 2] = float("nan")
        rows[5, -1] = float("nan")
        rows[6, -1] = float("inf")
        rows[7] = -0.0
        rows[8, 0] = rows[8, -1] = 1.0
        min_ps = [0.05, 0.25, 0.5, 0.1, 0.1, 0.1, 0.1, 0.3, 1.0, 0.0, 0.5]
        rows[10] = 0.125  # a threshold exactly on a probability (0.5 * 0.5): kept, not <
        rows[10, -1], rows[10, 0] = 0.25, 0.5
        mp = torch.tensor(min_ps).unsqueeze(1)
        want = rows.masked_fill(rows < rows.max(dim=-1, keepdim=True).values * mp, 0.0)
        got = apply_min_p(rows, min_ps)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), vocab
        for i in range(rows.shape[0]):
            alone = apply_min_p(rows[i : i + 1], min_ps[i : i + 1])
            assert torch.equal(alone.view(torch.int32), want[i : i + 1].view(torch.int32))
    if path == "c":
        from kernels.cpu import ops

        with pytest.raises(ValueError, match="min_p"):
            ops.min_p(torch.ones(2, 3), torch.ones(3))


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_top_p_sets_equal_the_sorted_method(
    scale: float, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apply_top_p` finds each row's cut in C (a histogram of the row, then a sort of the
    tokens around the cut) or in torch (among its 64 or 1024 best tokens, or from a
    histogram when the set is wider: flat rows, scale 0.3 over 20,000 tokens, leave
    thousands in the set); every path keeps exactly the tokens the plain method (sort,
    cumulative sum) keeps."""
    from engine.sampler import apply_top_p

    _top_p_path(path, monkeypatch)
    gen = torch.Generator().manual_seed(int(scale * 10))
    probs = (torch.randn(12, 20_000, generator=gen) * scale).softmax(dim=-1)
    top_ps = [0.5, 0.8, 0.9, 0.95, 0.99, 0.3] * 2
    kept = apply_top_p(probs, top_ps) > 0
    values, ids = probs.sort(dim=-1, descending=True)
    before = values.cumsum(dim=-1) - values
    limit = torch.tensor(top_ps).unsqueeze(1)
    want = torch.zeros_like(kept).scatter_(1, ids, before < limit)
    assert torch.equal(kept, want), (kept != want).sum(dim=-1)
    assert torch.equal(apply_top_p(probs, top_ps)[kept], probs[kept])  # kept as they were


def _sorted_cuts(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The plain method's cut: sort, cumsum, keep while the mass before < top_p."""
    values = probs.sort(dim=-1, descending=True).values
    kept = ((values.cumsum(dim=-1) - values) < top_ps.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    return values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)


def test_a_cpu_sampler_loads_its_kernel_at_construction() -> None:
    """The C top-p kernel is loaded when the sampler is built (at engine start), so a
    build it may need never runs on a request's path, even where the model itself runs
    no C kernel (the exact mode)."""
    from engine import sampler

    sampler._native.cache_clear()
    Sampler(torch.device("cpu"))
    assert sampler._native.cache_info().currsize == 1


def _c_cuts(ops, probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The C kernel's cuts, after checking its kept probabilities are masked_fill's."""
    kept, cuts = ops.top_p(probs, top_ps)
    want = probs.masked_fill(probs < cuts.unsqueeze(1), 0.0)
    assert torch.equal(kept.isnan(), want.isnan())
    assert torch.equal(kept.nan_to_num(-1.0), want.nan_to_num(-1.0))
    return cuts


def test_c_top_p_cuts_on_ties_tails_and_tiny_rows() -> None:
    """The C kernel's cut is the plain method's on the rows a histogram finds hardest: a
    cut inside a run of equal probabilities (uniform rows), a cut below 32 octaves under
    the top (the histogram's last bucket: everything is sorted), a one-hot row, a row of
    10 tokens, top_p at the 1e-8 floor and at 0.999999; each row alone or in a batch of
    rows of other top_p gives the same cut; a row of NaN gives a value without fault."""
    ops = pytest.importorskip("kernels.cpu.ops")
    if not ops.available():
        pytest.skip("the C kernels do not run on this host (no AVX2)")
    vocab = 4096
    gen = torch.Generator().manual_seed(7)
    tail = torch.full((vocab,), 1e-12)
    tail[:3] = torch.tensor([0.5, 0.3, 0.2 - 1e-12 * (vocab - 3)])
    one_hot = torch.zeros(vocab)
    one_hot[17] = 1.0
    rows = [
        torch.full((vocab,), 1.0 / vocab),
        torch.cat([torch.full((100,), 0.004), torch.full((vocab - 100,), 0.6 / (vocab - 100))]),
        tail,
        one_hot,
        (torch.randn(vocab, generator=gen) * 2).softmax(-1),
        (torch.randn(vocab, generator=gen) * 0.1).softmax(-1),
    ]
    for top_p in (1e-8, 0.3, 0.5, 0.9, 0.999999):
        probs = torch.stack(rows)
        tps = torch.full((len(rows),), top_p)
        got = _c_cuts(ops, probs, tps)
        assert torch.equal(got, _sorted_cuts(probs, tps)), (top_p, got)
        for i, row in enumerate(rows):  # alone: the same cut
            assert torch.equal(_c_cuts(ops, row.unsqueeze(0), tps[:1]), got[i : i + 1])
    small = (torch.randn(3, 10, generator=gen)).softmax(-1)
    tps = torch.tensor([0.2, 0.7, 0.95])
    assert torch.equal(_c_cuts(ops, small, tps), _sorted_cuts(small, tps))
    mixed = torch.stack(rows)
    tps = torch.tensor([0.1, 0.5, 0.9, 0.99, 0.7, 0.3])
    assert torch.equal(_c_cuts(ops, mixed, tps), _sorted_cuts(mixed, tps))
    nan = torch.full((1, vocab), float("nan"))
    assert _c_cuts(ops, nan, torch.tensor([0.9])).shape == (1,)
    with pytest.raises(ValueError, match="top_p"):  # no token to keep: refused, not read
        ops.top_p(torch.empty(2, 0), torch.tensor([0.9, 0.9]))


def test_penalised_logits_equal_transformers_and_openai_formulas() -> None:
    """The logits the sampler draws from, under each penalty, on a row whose prompt and
    output repeat ids and share some: repetition as transformers'
    RepetitionPenaltyLogitsProcessor over prompt + output, presence and frequency as
    OpenAI's formula over the output only. Read through logprobs=VOCAB-1 of greedy rows."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _logits(1)
    prompt, output = [3, 3, 7, 9], [7, 7, 12, 3, 20]
    history = torch.tensor([prompt + output])

    def drawn_from(**params: float) -> torch.Tensor:
        sampler = Sampler(torch.device("cpu"))
        for _ in range(2):  # the second step reads the cached prompt ids
            req = _req(
                "p", output=output, prompt=prompt, temperature=0, logprobs=VOCAB - 1, **params
            )
            (entry,) = sampler(logits, [req], EOS).logprobs or [None]
        assert entry is not None
        values = torch.full((VOCAB,), float("nan"))
        for token_id, logprob in entry.top:
            values[token_id] = logprob
        values[entry.token_id] = entry.logprob
        return values

    def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
        known = ~got.isnan()  # every token but the least likely one is reported
        assert int(known.sum()) >= VOCAB - 1
        assert torch.allclose(got[known], want[known], atol=1e-5)

    want = RepetitionPenaltyLogitsProcessor(1.7)(history, logits.clone()).log_softmax(-1)[0]
    assert_close(drawn_from(repetition_penalty=1.7), want)
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    manual = logits[0] - counts * 0.4 - (counts > 0).float() * 0.9
    assert_close(drawn_from(frequency_penalty=0.4, presence_penalty=0.9), manual.log_softmax(-1))


_TOP_P_UNDER_A_MEMORY_LIMIT = """
import resource, sys, torch
from kernels.cpu import ops
torch.set_num_threads(2)
ops.top_p(torch.rand(4, 64).softmax(-1), torch.full((4,), 0.9))  # the thread team exists
rows, vocab = 2, 1 << 24
probs = torch.zeros(rows, vocab)
probs[:, :2] = 0.5  # two tokens cover any top_p: the rest must come out 0
probs[:, 2:] = 1e-9
with open("/proc/self/status") as f:
    size = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
# room for the output (128 MiB) and the bookkeeping, not for the 256 MiB of scratch
resource.setrlimit(resource.RLIMIT_AS, (size + (192 << 20), resource.RLIM_INFINITY))
try:
    out, cuts = ops.top_p(probs, torch.full((rows,), 0.9))
except (RuntimeError, MemoryError) as e:
    print("raised", type(e).__name__)
    sys.exit(0)
print("answered: token 2 kept as", float(out[0, 2]), "cut", float(cuts[0]))
"""


def test_c_top_p_out_of_memory_raises_rather_than_keeping_every_token() -> None:
    """When the per-thread candidate buffers cannot be had, `ops.top_p` raises; it never
    answers with rows left unmasked (the kernel once allocated them itself and, on a failed
    `malloc`, kept every token of the row: nucleus sampling silently turned off). Run in a
    child whose address space is capped just above what the call needs besides them."""
    ops = pytest.importorskip("kernels.cpu.ops")
    if not ops.available():
        pytest.skip("the C kernels do not run on this host (no AVX2)")
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TOP_P_UNDER_A_MEMORY_LIMIT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("raised"), done.stdout
