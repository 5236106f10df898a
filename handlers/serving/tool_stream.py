"""Streaming tool calls and reasoning: text deltas in, OpenAI delta fields out.

`ToolCallStreamer` turns one choice's text deltas into `content` deltas and
`tool_calls` deltas the way OpenAI streams them: per call, a first fragment with `index`,
`id`, `type` and `function.name` (and the argument text of that chunk), then argument
text; one entry per index in a chunk. The SDK's stream helpers join fragments by `index`.

- named tool: the output *is* the arguments JSON, so it streams as argument fragments.
- `required`: the output is a JSON list of calls; it is parsed when complete.
- `auto`: text streams as content until a tool-call opening (`<tool_call>`, `[TOOL_CALLS]`,
  `<|python_tag|>`, or `{` at the very start for Llama 3 JSON) appears, holding back a
  tail that could still become one; from there it is buffered and parsed at the end. If
  it does not parse, the buffered text goes out as content, unchanged.

`ReasoningStreamer` routes text before `</think>` to `reasoning_content`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from handlers.protocol.chat import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
)
from handlers.serving.reasoning import CLOSE, OPEN
from handlers.serving.tool_parsers import START_MARKERS
from handlers.serving.tool_render import new_call_id, tool_calls_from_text


@dataclass(slots=True)
class StreamPiece:
    """What one text delta turns into; empty fields send nothing."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_delta(index: int, name: str, arguments: str) -> DeltaToolCall:
    """A call's first fragment: its index, id, type and name with the arguments so far.
    One entry per index per chunk, as OpenAI and vLLM send (SDK stream helpers before
    openai-python's same-index merge stranded a second entry of one index)."""
    return DeltaToolCall(
        index=index,
        id=new_call_id(),
        type="function",
        function=DeltaFunctionCall(name=name, arguments=arguments),
    )


class ToolCallStreamer:
    def __init__(self, request: ChatCompletionRequest, fmt: str) -> None:
        self._request = request
        self._mode = request.effective_tool_choice if request.tools else "none"
        self._fmt = fmt
        self._marker = START_MARKERS[fmt]
        self._seen = ""  # all text so far
        self._pending = ""  # held back (auto) or buffered (required / after a marker)
        self._buffering = False
        self._started = False
        self.num_calls = 0

    def feed(self, text: str) -> StreamPiece:
        if self._mode == "none":
            return StreamPiece(content=text)
        self._seen += text
        if self._mode == "named":
            return self._feed_named(text)
        if self._mode == "required" or self._buffering:
            self._pending += text
            return StreamPiece()
        return self._feed_auto(text)

    def _feed_named(self, text: str) -> StreamPiece:
        if not self._started:
            self._started = True
            tool = self._request.named_tool
            assert tool is not None
            self.num_calls = 1
            return StreamPiece(tool_calls=[_call_delta(0, tool.function.name, text)])
        if not text:
            return StreamPiece()
        return StreamPiece(
            tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        )

    def _feed_auto(self, text: str) -> StreamPiece:
        pending = self._pending + text
        opens_json = self._fmt == "llama3_json" and self._seen.lstrip().startswith("{")
        start = 0 if opens_json else pending.find(self._marker)
        if start >= 0:
            self._buffering = True
            self._pending = pending[start:]
            return StreamPiece(content=pending[:start])
        keep = _held_prefix(pending, self._marker)
        if self._fmt == "llama3_json" and not self._seen.strip():
            keep = len(pending)  # only whitespace yet: a JSON call may still open
        self._pending = pending[len(pending) - keep :] if keep else ""
        return StreamPiece(content=pending[: len(pending) - keep])

    def finish(self) -> StreamPiece:
        """Flush at the end of the choice: parse what was buffered."""
        pending, self._pending = self._pending, ""
        if self._mode in ("none", "named") or not pending:
            return StreamPiece(content=pending)
        content, calls = tool_calls_from_text(pending, self._request, self._fmt)
        if not calls:
            return StreamPiece(content=pending)
        deltas = [_call_delta(i, call.name, call.arguments) for i, call in enumerate(calls)]
        self.num_calls = len(calls)
        return StreamPiece(content=content or "", tool_calls=deltas)


class ReasoningStreamer:
    """Splits `<think>...</think>` off a stream; text after the close tag is content."""

    def __init__(self, enabled: bool) -> None:
        self._inside = enabled
        self._pending = ""
        self._seen_any = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of this delta."""
        if not self._inside:
            return "", text
        pending = self._pending + text
        if not self._seen_any:
            stripped = pending.lstrip()
            if OPEN.startswith(stripped) and len(stripped) < len(OPEN):
                self._pending = pending
                return "", ""
            self._seen_any = True
            if not stripped.startswith(OPEN):
                # NOTE: unlike the non-streaming split, a stream cannot wait for a
                # `</think>` that may never come: without an opening tag it is content.
                self._inside = False
                return "", pending
            pending = stripped[len(OPEN) :]
        end = pending.find(CLOSE)
        if end >= 0:
            self._inside = False
            self._pending = ""
            return pending[:end], pending[end + len(CLOSE) :].lstrip()
        keep = _held_prefix(pending, CLOSE)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], ""

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        return (pending, "") if self._inside else ("", pending)
