"""vLLM's `thinking_token_budget`: cap the tokens of a reasoning block (`<think>` ...
`</think>`, or a harmony analysis message) by forcing its closing tag once the block holds
`budget` tokens.

One `ThinkingTracker` per request follows the block state over the prompt (a template
may open the block itself) and then each generated token: inside a block it counts;
the closing tag's ids end the block, the opening tag's start a new one. When a block's
count reaches the budget, the closing tag is forced, one id a step, by leaving only that
id samplable (for harmony, the closing `<|end|>` and then the final channel's header:
`forced_ids`); the answer after it is sampled freely. A block the model closes itself
before the budget is untouched, and a request whose prompt ends inside a block counts
the block's prompt tokens too (vLLM's rule).
"""

from __future__ import annotations

from engine.sampling_params import ThinkingBudget


def _ends_with(tokens: list[int], end: int, tail: list[int]) -> bool:
    """Whether `tokens[:end]` ends with `tail` (no copy of the prefix)."""
    return bool(tail) and end >= len(tail) and tokens[end - len(tail) : end] == tail


def _last_index(tokens: list[int], seq: list[int]) -> int:
    """Where the last occurrence of `seq` starts in `tokens`, or -1."""
    if not seq:
        return -1
    for i in range(len(tokens) - len(seq), -1, -1):
        if tokens[i : i + len(seq)] == seq:
            return i
    return -1


class ThinkingTracker:
    """The reasoning-block state of one request (see the module docstring)."""

    def __init__(self, spec: ThinkingBudget, prompt: list[int]) -> None:
        self.spec = spec
        self.forced_seq = spec.forced_ids or spec.end_ids
        start = _last_index(prompt, spec.start_ids)
        end = _last_index(prompt, spec.end_ids)
        self.in_block = start > end
        self.count = len(prompt) - start - len(spec.start_ids) if self.in_block else 0
        self.forcing: int | None = None
        """While forcing: how many ids of `forced_seq` have been emitted (None: not
        forcing). Kept apart from the block state, since the forced ids may go past the
        closing tag (harmony's final-answer header)."""
        self.seen = 0
        """Output tokens folded in so far."""

    def forced_token(self, output: list[int]) -> int | None:
        """Fold in the output tokens not seen yet; the id to force this step, or None."""
        for i in range(self.seen, len(output)):
            self._fold(output, i + 1)
        self.seen = len(output)
        if self.forcing is None and self.in_block and self.count >= self.spec.budget:
            self.forcing = 0
        return None if self.forcing is None else self.forced_seq[self.forcing]

    def _fold(self, output: list[int], end: int) -> None:
        """Fold in `output[end - 1]`."""
        spec = self.spec
        if self.forcing is not None:  # this token is the forced one
            self.forcing += 1
            if self.forcing == len(self.forced_seq):
                self.forcing = None
        if self.in_block:
            if _ends_with(output, end, spec.end_ids):
                self.in_block, self.count = False, 0
            else:
                self.count += 1
        elif _ends_with(output, end, spec.start_ids):
            self.in_block, self.count = True, 0
