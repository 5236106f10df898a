"""The engine's state for one sequence: tokens, progress through the prompt, KV blocks."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.messages import PoolingParams, TokenLogprob
    from engine.pooler import PoolingState
    from engine.structured.grammar import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence in the engine (n > 1 arrives as n requests sharing a prompt).

    `num_computed_tokens` counts tokens whose K/V are in the cache; everything in
    `all_token_ids` past it still has to go through the model. After a preemption it
    drops to zero and the whole sequence (prompt and output so far) is recomputed.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "client_id",
        "ever_scheduled",
        "finish_reason",
        "grammar",
        "group",
        "lora_key",
        "lora_name",
        "lora_slot",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_freed_blocks",
        "num_prompt_tokens",
        "params",
        "pooled",
        "pooling",
        "pooling_uses_cache",
        "priority",
        "prompt_logprobs",
        "request_id",
        "session_id",
        "status",
        "stop_reason",
        "stop_token_set",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        client_id: bytes = b"",
        priority: int = 0,
        arrival_time: float | None = None,
        *,
        pooling: PoolingParams | None = None,
        session_id: str | None = None,
        group: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.group = request_id if group is None else group
        """The API request this sequence is one input or choice of (engine/waiting_queue.py:
        the inputs of one API request take turns with later arrivals)."""
        self.session_id = session_id
        """The stateful session this request belongs to: its blocks are pinned to it when
        freed (`BlockManager.free`), so the conversation's next turn hits them."""
        self.client_id = client_id
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens that came from the prefix cache at first admission."""
        self.ever_scheduled = False
        """Admitted to the running set once already: a readmission after preemption (even
        one mid-prompt, with no output yet) is no new prefix-cache query, and its hits on
        its own blocks are not the request's cached tokens."""
        self.block_ids: list[int] = []
        self.num_freed_blocks = 0
        """Leading `block_ids` already released because they fell out of the sliding
        window (engine/block_manager.py `free_outside_window`); the ids stay in the table
        (kernels never read them) so positions keep mapping to table entries."""
        self.block_hashes: list[bytes] = []
        """Hash chain of this sequence's full blocks, filled lazily by the block manager."""
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.stop_token_set = frozenset(params.stop_token_ids)
        """Checked for every generated token: a set, not the wire list."""
        self.lora_name: str | None = None
        self.lora_slot = -1
        """The resident LoRA slot this request pins (-1: the base model)."""
        self.lora_key = b""
        """Seeds the prefix-cache hash chain: KV computed under one adapter is never
        shared with another adapter or the base (engine/block_manager.py)."""
        self.cache_salt = b""
        """Seeds the chain too (vLLM's `cache_salt`): blocks are shared only between
        requests of the same salt."""
        self.grammar: GrammarState | None = None
        """Structured outputs: the matcher the sampler masks with (kept across a
        preemption: recompute only refills the KV cache of tokens it already accepted)."""
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        """Entries scored so far, one per prompt position (the first has nothing before it:
        None); None when the request did not ask for prompt logprobs. See prompt_logprobs.py."""
        self.pooling = pooling
        """Set for an embedding request: prefill only, nothing sampled, no KV kept."""
        self.pooling_uses_cache = False
        """An embedding request whose pooling reads only the last position (last-token
        pooling, a classifier's head): it may start after a prefix-cache hit and leave
        its blocks in the cache, since no other position's hidden state is needed."""
        self.pooled: PoolingState | None = None
        """An embedding request's pooling across its prefill chunks (engine/pooler.py)."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to be fed through the model before the next sample."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)}, {self.status.value})"
        )
