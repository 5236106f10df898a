"""Batched sampling: logits of the step's sampling rows -> one token each (+ logprobs).

The common case (no penalties, no bias, all greedy or all plain temperature) runs as a
handful of whole-batch tensor ops. Per-row work happens only for rows that asked for
per-request state: a seed (its own generator), penalties, logit_bias or min_tokens.
Random sampling inverts each row's cumulative distribution at one uniform draw (exact
multinomial sampling at one random number per row); seeded rows draw theirs from their
own generator while the rest share one batched draw.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.messages import TokenLogprob
from engine.request import Request
from engine.structured.grammar import apply_grammar_masks
from engine.thinking_budget import ThinkingTracker

MIN_TEMPERATURE = 1e-5
CDF_BLOCK = 256
"""Tokens per block of the two-level inverse-CDF draw (`Sampler._inverse_cdf`)."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None
    """Per row, when any row asked for logprobs."""


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu":
            _native("top_p")  # loads the C kernels now: a build, if one is due, at start
        self._generators: dict[str, torch.Generator] = {}
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """logit_bias as (ids, values) tensors, built once per request, not per step."""
        self._allowed: dict[str, torch.Tensor] = {}
        """allowed_token_ids as a mask of the ids it forbids, built once per request."""
        self._thinking: dict[str, ThinkingTracker] = {}
        """thinking_token_budget: each request's reasoning-block state."""
        self._prompt_seen: dict[str, torch.Tensor] = {}
        """repetition_penalty: each request's distinct prompt ids, found once (the prompt
        never changes), where every step used to sort the whole history again."""

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._biases.pop(request_id, None)
        self._allowed.pop(request_id, None)
        self._thinking.pop(request_id, None)
        self._prompt_seen.pop(request_id, None)

    def _forced_thinking_token(self, request: Request) -> int | None:
        spec = request.params.thinking
        assert spec is not None
        tracker = self._thinking.get(request.request_id)
        if tracker is None:
            tracker = ThinkingTracker(spec, request.all_token_ids[: request.num_prompt_tokens])
            self._thinking[request.request_id] = tracker
        return tracker.forced_token(request.output_token_ids)

    def _forbidden(self, request: Request, x: torch.Tensor) -> torch.Tensor:
        cached = self._allowed.get(request.request_id)
        if cached is None:
            cached = torch.ones(x.shape[-1], dtype=torch.bool, device=x.device)
            allowed = request.params.allowed_token_ids or []
            cached[torch.tensor(allowed, dtype=torch.long, device=x.device)] = False
            self._allowed[request.request_id] = cached
        return cached

    def _bias(self, request: Request, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._biases.get(request.request_id)
        if cached is None:
            bias = request.params.logit_bias or {}
            cached = (
                torch.tensor(list(bias.keys()), device=x.device),
                torch.tensor(list(bias.values()), device=x.device, dtype=x.dtype),
            )
            self._biases[request.request_id] = cached
        return cached

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.params.seed or 0)
            self._generators[request.request_id] = gen
        return gen

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, requests: list[Request], eos_token_ids: list[int]
    ) -> SamplerOutput:
        # logits: [num_rows, vocab] float32
        logits = self._apply_penalties_and_bias(logits, requests, eos_token_ids)
        if any(r.grammar is not None for r in requests):
            # Structured outputs: after penalties and bias, so nothing can re-allow a
            # token the grammar forbids; logprobs below see the masked distribution.
            logits = apply_grammar_masks(logits, requests)
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        # Temperatures this small overflow float32 logits / t: they mean greedy.
        temperatures = [
            r.params.temperature if r.params.temperature >= MIN_TEMPERATURE else 0.0
            for r in requests
        ]
        if all(t == 0.0 for t in temperatures):
            token_ids = greedy_ids(logits)
        else:
            token_ids = self._sample_random(logits, requests, temperatures)
        ids = token_ids.tolist()
        return SamplerOutput(
            ids, self._logprobs(logprobs, ids, requests) if want_logprobs else None
        )

    # -- logits processing ------------------------------------------------------------
    def _apply_penalties(self, x: torch.Tensor, request: Request) -> None:
        """OpenAI presence/frequency penalties over output tokens, and the multiplicative
        repetition penalty over prompt and output tokens (as vLLM / HF apply them).

        Only the tokens the sequence holds are touched (its distinct ids and their
        counts), and the prompt's distinct ids are found once: every step used to build
        a Python set of the whole history and make three passes over the vocabulary."""
        p = request.params
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=x.device)
        if p.repetition_penalty != 1.0:
            penalty = max(p.repetition_penalty, 1e-8)
            prompt = self._prompt_seen.get(request.request_id)
            if prompt is None:
                ids = request.all_token_ids[: request.num_prompt_tokens]
                prompt = torch.unique(torch.tensor(ids, dtype=torch.long, device=x.device))
                self._prompt_seen[request.request_id] = prompt
            # Repeated ids are harmless: each write is computed from the value read first.
            seen = torch.cat((prompt, output)) if output.numel() else prompt
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if output.numel() and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            ids, counts = torch.unique(output, return_counts=True)
            x[ids] -= counts.to(x.dtype) * p.frequency_penalty + p.presence_penalty

    def _apply_penalties_and_bias(
        self, logits: torch.Tensor, requests: list[Request], eos_token_ids: list[int]
    ) -> torch.Tensor:
        cloned = False
        for row, request in enumerate(requests):
            p = request.params
            needs_penalty = (
                p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0
            )
            needs_min_tokens = p.min_tokens > 0 and request.num_output_tokens < p.min_tokens
            if not (
                needs_penalty
                or p.logit_bias
                or needs_min_tokens
                or p.allowed_token_ids
                or p.bad_words_token_ids
                or p.thinking
            ):
                continue
            if not cloned:
                logits = logits.clone()
                cloned = True
            x = logits[row]
            if needs_penalty:
                self._apply_penalties(x, request)
            if p.logit_bias:
                ids, bias = self._bias(request, x)
                x.index_add_(0, ids, bias)
            if needs_min_tokens:
                banned = list(p.stop_token_ids)
                if not p.ignore_eos:
                    banned += eos_token_ids
                if banned:
                    x[torch.tensor(banned, device=x.device)] = float("-inf")
            if p.allowed_token_ids:
                x.masked_fill_(self._forbidden(request, x), float("-inf"))
            if p.bad_words_token_ids:
                _ban_bad_words(x, p.bad_words_token_ids, request.output_token_ids)
            if p.thinking is not None:
                forced = self._forced_thinking_token(request)
                if forced is not None:  # the budget is spent: only the closing tag
                    value = x[forced].clone()
                    x.fill_(float("-inf"))
                    x[forced] = value if bool(torch.isfinite(value)) else 0.0
        return logits

    def _sample_random(
        self, logits: torch.Tensor, requests: list[Request], temperatures: list[float]
    ) -> torch.Tensor:
        any_greedy = any(t == 0.0 for t in temperatures)
        greedy = greedy_ids(logits) if any_greedy else None
        scaled = logits
        if any(t not in (0.0, 1.0) for t in temperatures):
            temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
            scaled = logits / temps.unsqueeze(1)

        top_ks = [r.params.top_k for r in requests]
        top_ps = [r.params.top_p for r in requests]
        min_ps = [r.params.min_p for r in requests]
        vocab = scaled.shape[-1]
        candidates: torch.Tensor | None = None
        """Token ids of each row's top-k, when every sampled row names a small top_k: the
        draw then runs over those k columns alone (one partial sort of the vocabulary,
        then nothing vocabulary-wide), not over a masked copy of every logit."""
        sampled_ks = [k for k, t in zip(top_ks, temperatures, strict=True) if t > 0]
        if sampled_ks and all(0 < k <= TOP_K_CANDIDATES_MAX for k in sampled_ks):
            max_k = min(max(sampled_ks), vocab)
            scaled, candidates = scaled.topk(max_k, dim=-1)  # sorted, descending
            ks = [min(k, max_k) if k > 0 else max_k for k in top_ks]
            if any(k < max_k for k in ks):
                beyond = torch.arange(max_k, device=logits.device) >= torch.tensor(
                    ks, device=logits.device
                ).unsqueeze(1)
                scaled = scaled.masked_fill(beyond, float("-inf"))
        elif any(k > 0 for k in top_ks):
            ks_t = torch.tensor(
                [k if 0 < k < vocab else vocab for k in top_ks], device=logits.device
            )
            max_k = int(ks_t.max())
            top_vals = scaled.topk(max_k, dim=-1).values  # [rows, max_k]
            kth = top_vals.gather(1, (ks_t - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = scaled.softmax(dim=-1)
        if any(p < 1.0 for p in top_ps):
            probs = apply_top_p(probs, top_ps)
        if any(p > 0.0 for p in min_ps):
            probs = apply_min_p(probs, min_ps)

        sampled, drawn = self._inverse_cdf(probs, requests, temperatures)
        if candidates is not None:
            sampled = candidates.gather(1, sampled.unsqueeze(1)).squeeze(1)
        if not bool(drawn.all()):  # probabilities that are not numbers (NaN logits): argmax
            greedy = greedy_ids(logits) if greedy is None else greedy
            sampled = torch.where(drawn, sampled, greedy)
        if greedy is not None and any_greedy:
            is_greedy = torch.tensor([t == 0.0 for t in temperatures], device=logits.device)
            sampled = torch.where(is_greedy, greedy, sampled)
        return sampled

    def _inverse_cdf(
        self, probs: torch.Tensor, requests: list[Request], temperatures: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One multinomial draw per row: the first token whose cumulative probability
        passes u x total, u ~ U[0, 1); and whether the row could be drawn from at all.

        One uniform number per row, where the exponential race (argmax p / q, q ~ Exp(1))
        drew one per vocabulary entry: `exponential_` on CPU costs ~1 ms per row of a
        49,152-token vocabulary, single-threaded, 67 ms a step at 64 rows. The inversion
        runs in two levels so that no full-length float64 pass is needed: float32 sums of
        blocks of `CDF_BLOCK` tokens, their running total in float64 picks the block, then
        the block's own running total picks the token. A token's chance is its
        probability to float32 rounding of its block's sum (~1e-7 of the block); a zero-
        probability token has an empty interval and is never drawn. A seeded row draws
        its u from its own generator, so its tokens depend on its seed, not on its batch.
        """
        rows, vocab = probs.shape
        device = probs.device
        full = vocab // CDF_BLOCK
        sums = []
        if full:
            sums.append(probs[:, : full * CDF_BLOCK].reshape(rows, full, CDF_BLOCK).sum(-1))
        if vocab > full * CDF_BLOCK:
            sums.append(probs[:, full * CDF_BLOCK :].sum(-1, keepdim=True))
        block_cdf = torch.cat(sums, dim=1).to(torch.float64).cumsum(dim=1)
        total = block_cdf[:, -1:]
        drawn = (torch.isfinite(total) & (total > 0)).squeeze(1)

        u = torch.rand(rows, 1, dtype=torch.float64, device=device)
        for row, request in enumerate(requests):
            if request.params.seed is not None and temperatures[row] > 0:
                generator = self._generator(request)
                u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
        zero = torch.zeros_like(total)
        target = torch.minimum(u * total, torch.nextafter(total, zero))
        block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
        before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), zero)

        positions = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=device)
        inside = positions < vocab
        local = probs.gather(1, positions.clamp_(max=vocab - 1)).masked_fill_(~inside, 0.0)
        local_cdf = local.to(torch.float64).cumsum(dim=1)
        local_total = local_cdf[:, -1:]
        # The block's float32 sum and its float64 running total differ by rounding: keep
        # the remainder inside the block so it lands on a token with probability > 0.
        remainder = torch.minimum(target - before, torch.nextafter(local_total, zero)).clamp_(min=0)
        offset = torch.searchsorted(local_cdf, remainder, right=True).clamp_(max=CDF_BLOCK - 1)
        return (block * CDF_BLOCK + offset).squeeze(1), drawn

    @staticmethod
    def _logprobs(
        logprobs: torch.Tensor, ids: list[int], requests: list[Request]
    ) -> list[TokenLogprob | None]:
        ks = [r.params.logprobs for r in requests]
        chosen_sets = [r.params.logprob_token_ids for r in requests]
        max_k = max(
            (k for k, named in zip(ks, chosen_sets, strict=True) if k is not None and not named),
            default=0,
        )
        chosen = torch.tensor(ids, device=logprobs.device).unsqueeze(1)
        chosen_lp = logprobs.gather(1, chosen)  # [rows, 1]
        ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
        if max_k > 0:
            top_vals, top_ids = logprobs.topk(max_k, dim=-1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        chosen_l, ranks_l = chosen_lp.squeeze(1).tolist(), ranks.tolist()
        result: list[TokenLogprob | None] = []
        for row, k in enumerate(ks):
            if k is None:
                result.append(None)
                continue
            named = chosen_sets[row]
            if named:
                index = torch.tensor(named, dtype=torch.long, device=logprobs.device)
                top = list(zip(named, logprobs[row, index].tolist(), strict=True))
            elif k:
                top = list(zip(top_ids_l[row][:k], top_vals_l[row][:k], strict=True))
            else:
                top = []
            result.append(TokenLogprob(ids[row], chosen_l[row], ranks_l[row], top))
        return result


TOP_K_CANDIDATES_MAX = 1024
"""Largest top_k for which a batch is drawn from its top-k columns alone."""
TOP_P_CANDIDATES = (64, 1024)
"""How many of a row's most likely tokens `_top_p_cuts_torch` looks at first, then next: a
partial top-k is far cheaper than a sort on CPU (64 rows of 49,152 probabilities, 2
threads: 3.3 ms for 64 candidates, 17 ms for 1024, 128 ms for the sort), and a
language model's top-p set is nearly always among its first 64. Rows whose set is wider
still go to `_top_p_cuts_wide`."""
TOP_P_BUCKETS_PER_OCTAVE = 8
TOP_P_OCTAVES = 32
"""The histogram of `_top_p_cuts_wide`: buckets an eighth of an octave wide (a float32's
top 3 mantissa bits) over 32 octaves below a row's most likely token; what lies lower
shares the last bucket (a cut there is found by a full sort)."""
TOP_P_BUCKET_TOKENS_MAX = 4096
"""Most tokens in the sub-bucket that holds the cut for which it is ordered by a partial
top-k; past it the rows are sorted in full."""


def apply_top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """`probs` with 0 on every token outside each row's top-p set: the most likely
    tokens, in order, until the ones before a token already cover top_p (at least one
    is kept; a token tied with the last one kept is kept too). Rows with top_p >= 1 are
    left alone. The result is not renormalised: the draw divides by its row's total.

    The cut is one probability per row, found without sorting the vocabulary: on CPU by
    the C kernel (``kernels/cpu/hearth_sampling.c``: a histogram of the row, then a sort
    of only the tokens down to the cut; 64 rows of 49,152 in 5-20 ms on two cores, the
    masked rows included), elsewhere by `_top_p_cuts_torch`.
    """
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    device = probs.device
    whole = len(rows) == probs.shape[0]
    index = torch.tensor(rows, device=device)
    part = probs if whole else probs.index_select(0, index)
    tp = torch.tensor([top_ps[i] for i in rows], device=device, dtype=probs.dtype).clamp_(min=1e-8)
    native = _native("top_p") if part.device.type == "cpu" else None
    if native is not None and part.dtype == torch.float32:
        part = native(part, tp)[0]
    else:
        part = part.masked_fill(part < _top_p_cuts_torch(part, tp).unsqueeze(1), 0.0)
    return part if whole else probs.index_copy(0, index, part)


def _top_p_cuts_torch(part: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
    """Each row's cut in torch ops: among the row's `TOP_P_CANDIDATES` most likely tokens
    when those cover top_p, else from a histogram of the row (`_top_p_cuts_wide`). The
    plain method sorts every row (2 ms a row on CPU); 64 rows of a model unsure of its
    next token (random prompts: the sets held ~870 tokens, 29 rows past the first 1024)
    took 85 ms with a sort for the widest rows, ~35 ms with the histogram."""
    device = part.device
    cuts = torch.empty_like(tp)
    pending = torch.arange(part.shape[0], device=device)
    for k in TOP_P_CANDIDATES:
        if k >= part.shape[-1] or pending.numel() == 0:
            break
        candidates = part if pending.numel() == part.shape[0] else part.index_select(0, pending)
        found, covered = _cut_in_order(candidates.topk(k, dim=-1).values, tp[pending])
        cuts[pending[covered]] = found[covered]
        pending = pending[~covered]
    if pending.numel():
        wide = part if pending.numel() == part.shape[0] else part.index_select(0, pending)
        if TOP_P_CANDIDATES[0] < part.shape[-1]:
            cuts[pending] = _top_p_cuts_wide(wide, tp[pending])
        else:  # a vocabulary smaller than the candidates: sort it
            cuts[pending] = _cut_in_order(wide.sort(dim=-1, descending=True).values, tp[pending])[0]
    return cuts


def _cut_in_order(values: torch.Tensor, tp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of probabilities in descending order: the last one kept (a token is kept
    while the ones before it cover less than top_p), and whether the values given
    cover top_p at all (else the cut lies past them)."""
    cum = values.cumsum(dim=-1)
    limit = tp.unsqueeze(1)
    num_kept = ((cum - values) < limit).sum(dim=-1, keepdim=True).clamp_(min=1)
    return values.gather(1, num_kept - 1).squeeze(1), cum[:, -1] >= tp


def _top_p_cuts_wide(part: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
    """The cut of rows whose top-p set is wide, from histograms of each row. A float32's
    bits, read as an integer, grow with its value. Their top 12 bits (sign, exponent, 3
    mantissa bits) name its eighth of an octave: bucket k holds the tokens k eighths of
    an octave below the row's most likely one (the last bucket: everything lower, zeros
    included). The buckets' masses, summed from the top, name the bucket the cut lies
    in: every token above it is kept, every one below it is not. That bucket is split
    again by the next 8 mantissa bits, and only the tokens of the sub-bucket holding
    the cut are ordered (a partial top-k as wide as its largest count)."""
    num_buckets = TOP_P_BUCKETS_PER_OCTAVE * TOP_P_OCTAVES
    values32 = (part if part.dtype == torch.float32 else part.float()).contiguous()
    bits = values32.view(torch.int32)
    keys = bits >> 20
    top = keys.max(dim=-1, keepdim=True).values
    buckets = (top - keys).clamp_(0, num_buckets - 1).to(torch.long)
    limit = tp.to(torch.float64).unsqueeze(1)
    bucket, before = _bucket_of_cut(values32, buckets, num_buckets, limit)
    if bool((bucket == num_buckets - 1).any()):  # the cut lies in the tail: sort
        return _cut_in_order(part.sort(dim=-1, descending=True).values, tp)[0]
    # The cut's bucket, split by the next 8 bits (descending); other tokens go to bin 256.
    fine = 255 - ((bits >> 12) & 0xFF)
    sub = torch.where(buckets == bucket, fine.to(torch.long), 256)
    sub_bucket, sub_before = _bucket_of_cut(values32, sub, 257, limit - before)
    in_sub = sub == sub_bucket
    width = int(in_sub.sum(dim=-1).max())
    if width > TOP_P_BUCKET_TOKENS_MAX:
        return _cut_in_order(part.sort(dim=-1, descending=True).values, tp)[0]
    values = torch.where(in_sub, values32, -1.0).topk(width, dim=-1).values.clamp_(min=0.0)
    need = (limit - before - sub_before).to(values.dtype).squeeze(1)
    return _cut_in_order(values, need)[0].to(part.dtype)


def _bucket_of_cut(
    values: torch.Tensor, buckets: torch.Tensor, num_buckets: int, limit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bucket where the running mass of the buckets, in order, reaches `limit`; the
    mass before it), per row."""
    mass = torch.zeros(values.shape[0], num_buckets, dtype=values.dtype, device=values.device)
    cum = mass.scatter_add_(1, buckets, values).to(torch.float64).cumsum(dim=-1)
    bucket = (cum < limit).sum(dim=-1, keepdim=True).clamp_(max=num_buckets - 1)
    before = torch.where(bucket > 0, cum.gather(1, (bucket - 1).clamp_(min=0)), 0.0)
    return bucket, before


def apply_min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """`probs` with 0 on every token less likely than its row's min_p times the row's most
    likely token (vLLM's and transformers' min-p; a row with min_p 0 keeps everything).

    On CPU the C kernel reads each row twice (its largest value, then the masked copy)
    where the torch ops below make five passes and a byte mask: 64 rows of 49,152, 2
    threads, docs/performance.md ("min_p in C"). The two give the same bits."""
    mp = torch.tensor(min_ps, device=probs.device, dtype=torch.float32)
    native = _native("min_p") if probs.device.type == "cpu" else None
    if native is not None and probs.dtype == torch.float32:
        return native(probs, mp)
    threshold = probs.max(dim=-1, keepdim=True).values * mp.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def greedy_ids(scores: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest score (the first one on ties, NaN counting as largest).

    ``max(dim).indices`` is `argmax` by torch's contract (first maximal index, NaN
    propagates), and 2.5x faster than it (64 rows of SmolLM2's 49,152 logits, 2 threads,
    Sapphire Rapids: 0.83 vs 2.15 ms). On CPU the C kernel gives the same index ten times
    faster again (AVX2 Zen 3: 0.34 vs 3.57 ms at 64 rows, 0.09 vs 0.84 at 16): a row is read
    once, eight lanes at a time, where torch's reduction keeps a value and an index per
    element.
    """
    native = _native("argmax") if scores.device.type == "cpu" else None
    if native is not None and scores.dtype == torch.float32 and scores.dim() == 2:
        return native(scores)
    return scores.max(dim=-1).indices


@functools.cache
def _native(kernel: str) -> Callable[..., Any] | None:
    """The C kernels' sampling function `kernel` (``kernels/cpu/ops.py``: top_p, min_p,
    argmax) where they run on this host, else None (torch ops then)."""
    from kernels.cpu import ops

    return getattr(ops, kernel) if ops.available() else None


def _ban_bad_words(x: torch.Tensor, sequences: list[list[int]], output: list[int]) -> None:
    """vLLM's bad words: ban each sequence's last id where the output ends with the ids
    before it. When that would leave the row nothing to sample (allowed_token_ids or
    min_tokens already banned the rest), the bad words give way: a token is always
    sampled from what the other rules allow."""
    banned = [
        ids[-1]
        for ids in sequences
        if len(ids) == 1 or (len(ids) - 1 <= len(output) and output[1 - len(ids) :] == ids[:-1])
    ]
    if not banned:
        return
    index = torch.tensor(banned, dtype=torch.long, device=x.device)
    kept = x[index]
    x[index] = float("-inf")
    if bool(torch.isneginf(x).all()):
        x[index] = kept
