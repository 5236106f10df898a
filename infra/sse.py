"""Incremental Server-Sent Events parsing over arbitrary byte chunks.

``InvokeEndpointWithResponseStream`` hands the client ``PayloadPart`` byte chunks whose
boundaries have nothing to do with the container's SSE events: a part can end in the middle
of an event, of a line, of a ``\\r\\n`` pair or of a multi-byte UTF-8 character.  This parser
buffers across chunks, decodes UTF-8 incrementally, and yields the ``data`` of each complete
event as the WHATWG SSE rules define it (multi-line ``data:`` fields joined with ``\\n``,
comment lines such as the ``: ping`` keep-alive ignored, other fields ignored).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator

__all__ = ["SSEParser", "iter_sse_data"]

_LINE_END = re.compile(r"\r\n|\r|\n")


class SSEParser:
    """Feed bytes, get the ``data`` string of every event completed so far."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        self._buffer = ""
        self._data: list[str] = []
        self._has_data = False

    def feed(self, chunk: bytes) -> list[str]:
        """Add a chunk; return the data of the events it completed (possibly none)."""
        self._buffer += self._decoder.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[str]:
        """End of stream: flush a last event that lacks its blank line.

        Strict SSE would drop such an event; a client is better off seeing it (a server
        that forgot the final blank line after ``data: [DONE]`` still ends cleanly).
        A stream cut inside a UTF-8 character raises ``UnicodeDecodeError``.
        """
        self._buffer += self._decoder.decode(b"", final=True)
        events = self._drain(final=True)
        if self._buffer:
            self._line(self._buffer)
            self._buffer = ""
        if self._has_data:
            events.append(self._dispatch())
        return events

    def _drain(self, final: bool) -> list[str]:
        events: list[str] = []
        pos = 0
        buf = self._buffer
        while True:
            match = _LINE_END.search(buf, pos)
            if match is None:
                break
            # A lone "\r" at the very end may be the first half of "\r\n": wait for more.
            if match.group() == "\r" and match.end() == len(buf) and not final:
                break
            line = buf[pos : match.start()]
            pos = match.end()
            if line == "":
                if self._has_data:
                    events.append(self._dispatch())
                continue
            self._line(line)
        self._buffer = buf[pos:]
        return events

    def _line(self, line: str) -> None:
        if line.startswith(":"):
            return  # comment / keep-alive
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_data = True

    def _dispatch(self) -> str:
        data = "\n".join(self._data)
        self._data = []
        self._has_data = False
        return data


def iter_sse_data(chunks: Iterable[bytes]) -> Iterator[str]:
    """Yield the data of each SSE event in a stream of byte chunks, as soon as complete."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()
