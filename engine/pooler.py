"""Embeddings: the pooled final hidden state of an embedding request's prompt.

An embedding request is prefill only. It is scheduled like any prompt (in the same steps
as generation requests, under the same token budget, chunked when long); each step's
hidden states (the model's output after the final norm: transformers'
`last_hidden_state`, what sentence-transformers pools) are folded into the request's
`PoolingState` chunk by chunk, so chunked prefill needs no second pass and nothing of
shape `[prompt_len, hidden]` is kept:

- `last`: the hidden state of the prompt's last token (the chunk that reaches it);
- `cls`: the first token's (the chunk that starts at position 0);
- `mean`: a running float32 sum of every row, divided by the prompt length at the end.

A chunk that starts at position 0 starts the state afresh, which is what makes a
preempted request (recomputed from scratch) pool each token once. When the prompt's
last chunk has run, the vector is truncated to `dimensions` (Matryoshka), normalised
when the model prescribes it (or the request says so: `PoolingParams.normalize`), and
returned as float32 bytes (little endian); a sequence classifier's row goes through its
head instead, and its logits are returned. The core then finishes the request, which
frees its blocks; they enter the prefix cache only under last-token pooling, which
reads no position a cache hit skips (`Request.pooling_uses_cache`).

Row bookkeeping follows `engine/prompt_logprobs.py`: `ordered` is the step's sequences
in the order their tokens were flattened into `hidden`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.pooling_config import PoolingConfig
from engine.request import Request
from engine.scheduler import ScheduledRequest


@dataclass(slots=True)
class PoolingState:
    """What one embedding request has pooled so far."""

    value: torch.Tensor | None = None
    """float32 `[hidden]`: the running sum (mean), or the chosen row (cls, last)."""
    num_rows: int = 0
    """Prompt positions folded in so far."""


class Pooler:
    """Folds each step's hidden rows into the embedding requests' states."""

    def __init__(
        self,
        config: PoolingConfig,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.head = head
        """A sequence classifier's `classify` (engine/models/classifier.py): a pooled
        row becomes its float32 logits, returned as they are."""

    def pool_step(
        self, hidden: torch.Tensor, ordered: list[ScheduledRequest]
    ) -> list[tuple[Request, bytes]]:
        """Fold this step's rows in; returns the embedding of each request whose prompt
        this step completed (the core finishes those)."""
        done: list[tuple[Request, bytes]] = []
        row = 0
        for item in ordered:
            request = item.request
            if request.pooling is not None:
                start = request.num_computed_tokens
                self._fold(request, start, hidden[row : row + item.num_new_tokens])
                if start + item.num_new_tokens >= request.num_prompt_tokens:
                    done.append((request, self._finish(request)))
            row += item.num_new_tokens
        return done

    def _fold(self, request: Request, start: int, rows: torch.Tensor) -> None:
        state = request.pooled
        if state is None or start == 0:
            state = request.pooled = PoolingState()
        method = self.config.method
        # NOTE: copies, never views: the rows may live in a CUDA graph's or the CPU step
        # program's persistent buffer, which the next step overwrites.
        if method == "mean":
            chunk_sum = rows.sum(dim=0, dtype=torch.float32)
            state.value = chunk_sum if state.value is None else state.value + chunk_sum
        elif method == "cls":
            if start == 0:
                state.value = rows[0].to(torch.float32, copy=True)
        else:  # last
            if start + rows.shape[0] >= request.num_prompt_tokens:
                state.value = rows[request.num_prompt_tokens - 1 - start].to(
                    torch.float32, copy=True
                )
        state.num_rows = start + rows.shape[0]

    def _finish(self, request: Request) -> bytes:
        state = request.pooled
        assert state is not None and state.value is not None and request.pooling is not None
        request.pooled = None
        vector = state.value
        if self.head is not None:
            return self.head(vector.unsqueeze(0))[0].cpu().numpy().astype("<f4").tobytes()
        if self.config.method == "mean":
            vector = vector / request.num_prompt_tokens
        dimensions = request.pooling.dimensions
        if dimensions is not None:
            vector = vector[:dimensions]
        normalize = request.pooling.normalize
        if self.config.normalize if normalize is None else normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector.cpu().numpy().astype("<f4").tobytes()
