"""Stop strings, matched on detokenized text in the API worker.

The engine knows token ids only; a stop string can span several tokens and begin in
the middle of one. So text is released to the client only once no stop string can
still start inside it: any tail that is a prefix of some stop string is held back
until the next delta proves it harmless (or completes the match). A stream therefore
never shows even part of a stop string, and streamed text equals non-streamed text.

Each stop string runs a Knuth-Morris-Pratt automaton over the text, so the work per
character is constant however long the stop strings are: a client cannot make the
event loop spin with long, self-similar stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    text: str
    """Text that may be released now."""
    stop: str | None = None
    """The stop string that matched; the sequence is finished and its request must be aborted."""


class _Automaton:
    """KMP matcher of one stop string; `state` = longest prefix of it that ends the text."""

    __slots__ = ("failure", "pattern", "state")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.state = 0
        failure = [0] * len(pattern)
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = failure[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            failure[i] = k
        self.failure = failure

    def step(self, char: str) -> bool:
        """Advance by one character; True when the whole pattern now ends the text."""
        pattern, state = self.pattern, self.state
        while state and pattern[state] != char:
            state = self.failure[state - 1]
        if pattern[state] == char:
            state += 1
        if state == len(pattern):
            self.state = self.failure[state - 1]
            return True
        self.state = state
        return False


class StopStringMatcher:
    """Incremental stop-string search with hold-back over one sequence's text.

    Only the unreleased tail is kept (a few characters): the automata carry all the
    state a match needs, so the work per delta does not grow with the output.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self._automata = [_Automaton(s) for s in dict.fromkeys(stops) if s]
        self._include = include_stop_str_in_output
        self._pending = ""
        """Text after `_released`, not sent yet."""
        self._released = 0
        """Characters released so far (absolute offset of `_pending`)."""

    def feed(self, delta: str, *, check: bool = True) -> StopResult:
        """Add newly detokenized text; return what can be released and whether it stopped.

        `check=False` (before min_tokens is reached) appends without matching and holds
        nothing back, as vLLM ignores stop strings until then.
        """
        if not self._automata:
            return StopResult(delta)
        base = self._released + len(self._pending)
        self._pending += delta
        match: tuple[int, str] | None = None
        for offset, char in enumerate(delta):
            end = base + offset + 1
            for automaton in self._automata:
                if automaton.step(char) and check and match is None:
                    start = end - len(automaton.pattern)
                    if start >= self._released:
                        match = (start, automaton.pattern)
            if match is not None:
                # NOTE: the first stop string to complete wins; what follows it is dropped.
                break
        total = self._released + len(self._pending)
        if match is not None:
            start, stop = match
            return StopResult(self._release(start + len(stop) if self._include else start), stop)
        if not check:
            return StopResult(self._release(total))
        holdback = max(a.state for a in self._automata)
        return StopResult(self._release(total - holdback))

    def flush(self) -> str:
        """The sequence ended for another reason: everything held back is real output."""
        return self._release(self._released + len(self._pending))

    def _release(self, end: int) -> str:
        count = max(0, end - self._released)
        out, self._pending = self._pending[:count], self._pending[count:]
        self._released += count
        return out
