"""SSE reassembly across arbitrary byte boundaries (the PayloadPart problem)."""

from __future__ import annotations

import pytest

from infra.sse import SSEParser, iter_sse_data

STREAM = (
    'data: {"text": "héllo 世界 🎉"}\n\n'
    ": ping\n\n"
    "event: message\r\nid: 7\r\ndata: line one\r\ndata: line two\r\n\r\n"
    "data:no-space\r\rdata: [DONE]\n\n"
).encode()
EXPECTED = ['{"text": "héllo 世界 🎉"}', "line one\nline two", "no-space", "[DONE]"]


def test_whole_stream_in_one_chunk() -> None:
    assert list(iter_sse_data([STREAM])) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_fixed_size_chunks_split_events_lines_and_characters(size: int) -> None:
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert list(iter_sse_data(chunks)) == EXPECTED


def test_every_single_split_point() -> None:
    # Two chunks, cut at every byte: inside multi-byte chars, between \r and \n, mid-event.
    for cut in range(len(STREAM) + 1):
        assert list(iter_sse_data([STREAM[:cut], STREAM[cut:]])) == EXPECTED, cut


def test_events_are_yielded_as_soon_as_complete() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n") == []
    assert parser.feed(b"\ndata: b") == ["a"]
    assert parser.feed(b"\n\n") == ["b"]


def test_cr_at_chunk_end_is_not_taken_for_a_blank_line() -> None:
    parser = SSEParser()
    # "\r" then "\n" in the next chunk is one line ending, not two.
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r\n\r\n") == ["a\nb"]


def test_close_flushes_a_final_event_without_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == ["[DONE]"]


def test_comments_and_unknown_fields_yield_nothing() -> None:
    assert list(iter_sse_data([b": keep-alive\n\nretry: 10\nevent: x\n\n"])) == []


def test_stream_cut_inside_a_character_raises_on_close() -> None:
    parser = SSEParser()
    parser.feed("data: é".encode()[:-1])
    with pytest.raises(UnicodeDecodeError):
        parser.close()
