"""StopStringMatcher against a brute-force reference, delta by delta."""

from __future__ import annotations

import random

import pytest

from handlers.serving.stop import StopStringMatcher, _Automaton


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Output text and matched stop of the whole text: the first stop to complete."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        index = text.find(stop)
        if index >= 0:
            candidate = (index + len(stop), index, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    if best is None:
        return text, None
    end, start, stop = best
    return text[: end if include else start], stop


def run(deltas: list[str], stops: list[str], include: bool = False) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops, include)
    released: list[str] = []
    for delta in deltas:
        result = matcher.feed(delta)
        released.append(result.text)
        if result.stop is not None:
            return released, result.stop
    released.append(matcher.flush())
    return released, None


def test_stop_spanning_deltas_is_never_released_partially() -> None:
    released, stop = run(["Hello wor", "ld! S", "T", "OP and more"], ["STOP"])
    assert stop == "STOP"
    assert "".join(released) == "Hello world! "
    assert released == ["Hello wor", "ld! ", "", ""]


def test_include_stop_str_in_output() -> None:
    released, stop = run(["a ST", "OP b"], ["STOP"], include=True)
    assert (stop, "".join(released)) == ("STOP", "a STOP")


def test_false_alarm_is_released_when_disproved() -> None:
    released, stop = run(["x ST", "ART y"], ["STOP"])
    assert stop is None
    assert released == ["x ", "START y", ""]


def test_held_tail_flushes_at_the_end() -> None:
    released, stop = run(["the end S", "TO"], ["STOP"])
    assert stop is None and "".join(released) == "the end STO"


def test_min_tokens_window_ignores_earlier_text() -> None:
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("xab", check=False).text == "xab"
    result = matcher.feed("zab")
    assert (result.text, result.stop) == ("z", "ab")


class _CountingAutomaton(_Automaton):
    """The matcher's KMP automaton, counting characters stepped and failure links followed."""

    __slots__ = ()
    steps = 0
    links = 0

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        counted = self

        class Links(list):
            def __getitem__(self, index):  # type: ignore[no-untyped-def]
                type(counted).links += 1
                return super().__getitem__(index)

        self.failure = Links(self.failure)

    def step(self, char: str) -> bool:
        type(self).steps += 1
        return super().step(char)


def test_self_similar_long_stop_is_linear() -> None:
    stop = "a" * 5000 + "b"
    matcher = StopStringMatcher([stop])
    _CountingAutomaton.steps = _CountingAutomaton.links = 0
    matcher._automata = [_CountingAutomaton(stop)]
    for _ in range(100):
        assert matcher.feed("a" * 50).text == ""  # all could still become the stop
    assert matcher.feed("a" * 50).text == "a" * 50  # now too long to be a prefix of it
    assert matcher.feed("c").text == "a" * 5000 + "c"
    # Work, not time: each of the 5,051 characters fed is stepped once, and KMP follows at
    # most one failure link per character, amortized. A matcher that re-scanned its
    # held-back tail on every delta would step about 250,000 times.
    assert _CountingAutomaton.steps == 5051
    assert _CountingAutomaton.links <= 5051


@pytest.mark.parametrize("seed", range(40))
def test_random_against_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abST O"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
    include = rng.random() < 0.5
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 10))))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    released, stop = run(deltas, stops, include)
    expected_text, expected_stop = reference(text, stops, include)
    assert ("".join(released), stop) == (expected_text, expected_stop)
    # Never a byte more than the final output, at any point of the stream.
    so_far = ""
    for piece in released:
        so_far += piece
        assert expected_text.startswith(so_far)
