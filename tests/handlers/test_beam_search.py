"""The beam search's bookkeeping (handlers/serving/beam_search.py) on hand-made step
entries: which candidates close a beam, which go on, the final ranking, and the answer
when fewer beams than the width exist. The search against a real model is
tests/e2e/test_beam_search_real.py."""

from __future__ import annotations

import math

from engine.messages import TokenLogprob
from handlers.serving.beam_search import Beam, BeamSearch, beam_score, final_outputs

EOS = 99


def _search(width: int, ignore_eos: bool = False, penalty: float = 1.0) -> BeamSearch:
    return BeamSearch(
        width=width, max_tokens=8, length_penalty=penalty, ignore_eos=ignore_eos,
        eos_token_ids=frozenset({EOS}), num_logprobs=1,
    )  # fmt: skip


def _entry(*top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id=top[0][0], logprob=top[0][1], rank=1, top=list(top))


def test_eos_closes_a_beam_and_the_best_others_go_on() -> None:
    search = _search(width=2)
    beams = [Beam([1, 2], -1.0), Beam([1, 3], -2.0)]
    steps = [_entry((EOS, -0.1), (5, -0.5), (6, -3.0)), _entry((7, -0.2), (8, -0.4))]
    opened, closed = search.extend(beams, steps)
    assert [b.tokens for b in closed] == [[1, 2, EOS]] and closed[0].ended
    assert math.isclose(closed[0].cum_logprob, -1.1)
    assert [b.tokens for b in opened] == [[1, 2, 5], [1, 3, 7]]  # -1.5, -2.2 beat -2.4
    # each chosen token's logprob entry: its logprob, its rank among the candidates
    assert (opened[0].logprobs[-1].logprob, opened[0].logprobs[-1].rank) == (-0.5, 2)


def test_ignore_eos_keeps_eos_as_an_ordinary_token() -> None:
    opened, closed = _search(width=1, ignore_eos=True).extend(
        [Beam([1], 0.0)], [_entry((EOS, -0.1), (5, -0.5))]
    )
    assert closed == [] and opened[0].tokens == [1, EOS] and not opened[0].ended


def test_the_score_divides_by_length_without_a_final_eos() -> None:
    ended = Beam([1, 2, 3, EOS], -3.0, ended=True)
    assert beam_score(ended, 1.0) == -1.0  # 3 tokens counted
    assert beam_score(Beam([1, 2, 3, 4], -3.0), 0.0) == -3.0
    longer = Beam([1, 2, 3, 4, 5, 6], -4.0)  # -4/6 = -0.67: the best
    ranked = _search(width=2).best([Beam([1, 2], -3.0), ended, longer])  # -1.5 last
    assert ranked == [longer, ended]


def test_fewer_beams_than_the_width_repeat_the_best() -> None:
    """A vocabulary narrower than the width (every other logprob -inf): each of the n
    choices still gets an answer."""
    opened, _ = _search(width=3).extend([Beam([1], 0.0)], [_entry((5, -0.1), (6, -math.inf))])
    assert [b.tokens for b in opened] == [[1, 5]]
    assert [b.tokens for b in _search(width=3).best(opened)] == [[1, 5]] * 3


def test_final_outputs_are_finished_choices() -> None:
    beams = [Beam([1, 2, 7, EOS], -1.0, ended=True), Beam([1, 2, 8, 9], -2.0)]
    first, second = final_outputs(beams, "cmpl-x", 4, prompt_len=2, with_logprobs=False)
    assert (first.request_id, first.new_token_ids, first.finish_reason) == (
        "cmpl-x-4",
        [7, EOS],
        "stop",
    )
    assert first.finished_on_stop_token and first.stop_reason == EOS
    assert (second.request_id, second.finish_reason, second.stop_reason) == (
        "cmpl-x-5",
        "length",
        None,
    )
    assert second.num_prompt_tokens == 2 and second.new_logprobs is None
