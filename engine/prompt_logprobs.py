"""Log-probabilities of the prompt's own tokens (scoring, `echo` + `logprobs`, `prompt_logprobs`).

Row `p` of a step's hidden states predicts token `p + 1`, so a prefill chunk covering
positions `[start, end)` scores prompt tokens `start + 1 .. end` (the first prompt token
has nothing before it and is never scored: its entry is None, as in vLLM). Chunked
prefill therefore needs nothing special: every chunk scores its own rows, and the
request accumulates the entries in position order.

Memory stays bounded however long the prompt: the vocabulary-wide log-softmax is taken
over at most `max_rows_per_chunk(vocab)` rows at a time (~32 MiB of float32 logits),
and only the target's log-prob, its rank and the top k survive each chunk. Nothing of
shape `[prompt_len, vocab]` ever exists.

Prefix caching and prompt logprobs do not mix: a cached block has K/V but no hidden
states to score, so the scheduler never gives a prefix-cache hit to a request that asks
for prompt logprobs (vLLM does the same); its own blocks still go into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.messages import TokenLogprob
from engine.request import Request
from engine.scheduler import ScheduledRequest

LOGITS_ELEMENTS_PER_CHUNK = 1 << 23
"""Float32 logits materialised at once (32 MiB): bounds the transient memory of scoring."""


def max_rows_per_chunk(vocab_size: int) -> int:
    return max(1, LOGITS_ELEMENTS_PER_CHUNK // max(vocab_size, 1))


@dataclass(slots=True)
class PromptScoring:
    """The prompt tokens one request scores in this step."""

    request: Request
    first_row: int
    """Row of the step's flat hidden states that predicts the first target."""
    target_ids: list[int]
    """Prompt tokens scored by rows first_row, first_row + 1, ... (one each)."""


def plan(request: Request, row_of_start: int, num_new_tokens: int) -> PromptScoring | None:
    """Which of this chunk's rows score prompt tokens not scored yet (None: nothing to do).

    `row_of_start` is the flat row of position `request.num_computed_tokens`. Positions
    already scored (a recompute after preemption) are skipped, so each prompt token gets
    exactly one entry.
    """
    scored = request.prompt_logprobs
    if scored is None:
        return None
    start = request.num_computed_tokens
    # Target positions t in [first, last): t = p + 1 for rows p of this chunk.
    first = max(start + 1, len(scored))
    last = min(start + num_new_tokens + 1, request.num_prompt_tokens)
    if first >= last:
        return None
    return PromptScoring(
        request=request,
        first_row=row_of_start + (first - 1 - start),
        target_ids=request.all_token_ids[first:last],
    )


@torch.inference_mode()
def score(
    model: torch.nn.Module, hidden: torch.Tensor, jobs: list[PromptScoring]
) -> list[list[TokenLogprob]]:
    """Per job, one TokenLogprob per target: its log-prob, its rank (1 = most likely) and
    the top `request.params.prompt_logprobs` alternatives, most likely first."""
    if not jobs:
        return []
    device = hidden.device
    rows: list[int] = []
    targets: list[int] = []
    for job in jobs:
        rows.extend(range(job.first_row, job.first_row + len(job.target_ids)))
        targets.extend(job.target_ids)
    max_k = max(job.request.params.prompt_logprobs or 0 for job in jobs)
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    target_index = torch.tensor(targets, dtype=torch.long, device=device)

    target_lps: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    step = max_rows_per_chunk(int(model.vocab_size))
    for begin in range(0, len(rows), step):
        end = begin + step
        logits = model.compute_logits(hidden.index_select(0, row_index[begin:end]))  # [n, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        del logits
        chosen = logprobs.gather(1, target_index[begin:end].unsqueeze(1))  # [n, 1]
        ranks.extend(((logprobs > chosen).sum(dim=-1) + 1).tolist())
        target_lps.extend(chosen.squeeze(1).tolist())
        if max_k:
            values, ids = logprobs.topk(max_k, dim=-1)
            top_lps.extend(values.tolist())
            top_ids.extend(ids.tolist())
        del logprobs

    out: list[list[TokenLogprob]] = []
    i = 0
    for job in jobs:
        k = job.request.params.prompt_logprobs or 0
        entries = []
        for token_id in job.target_ids:
            top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if k else []
            entries.append(TokenLogprob(token_id, target_lps[i], ranks[i], top))
            i += 1
        out.append(entries)
    return out


def score_step(
    model: torch.nn.Module, hidden: torch.Tensor, ordered: list[ScheduledRequest]
) -> list[tuple[Request, list[TokenLogprob]]]:
    """Score every prompt token this step reaches for the requests that asked for it.

    `ordered` is the step's sequences in the order their tokens were flattened into
    `hidden` (one row per new token).
    """
    jobs: list[PromptScoring] = []
    row = 0
    for item in ordered:
        job = plan(item.request, row, item.num_new_tokens)
        if job is not None:
            jobs.append(job)
        row += item.num_new_tokens
    if not jobs:
        return []
    return [
        (job.request, entries)
        for job, entries in zip(jobs, score(model, hidden, jobs), strict=True)
    ]
