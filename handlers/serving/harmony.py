"""gpt-oss's harmony output: channels into `reasoning_content`, `content` and tool calls.

A harmony answer is a run of messages, each ``<|start|>ROLE`` (the first one's is in the
prompt), a header, ``<|message|>``, the body, and a terminator (``<|end|>``; ``<|call|>``
after a tool call, ``<|return|>`` after the final answer; both are stop tokens, so the
detokenized text usually ends without them):

- ``<|channel|>analysis<|message|>…<|end|>``: chain of thought → `reasoning_content`;
- ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>``
  (the recipient may also stand before the channel, ``assistant to=functions.NAME
  <|channel|>commentary json``): a call of tool NAME with that body as its arguments;
- ``<|channel|>final<|message|>…<|return|>``: the answer → `content`; so is a
  ``commentary`` message without a recipient (a preamble the model shows the user);
- a message to another recipient (the built-in ``browser.*`` / ``python`` tools, which
  hearth does not run) is reasoning: kept visible, never executed.

NOTE: this is a small parser of hearth's own over the detokenized text (harmony
outputs are detokenized with their special tokens kept, `ServingChat.start`), not the
`openai-harmony` package: that one loads its tiktoken vocabulary from the network at
run time, and hearth fetches nothing at run time.

Text that is not harmony (no header at the start) is content, and a call to a tool the
request did not offer stays content (its body), so a wrong guess never loses output, as
for the other tool formats (handlers/serving/tool_parsers.py). `HarmonyParser` is
incremental: the stream (`HarmonyStreamer`) and the whole-text parse (`parse_harmony`)
are the same code, so a streamed answer equals the non-streamed one however the text is
cut into deltas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from handlers.protocol.chat import DeltaFunctionCall, DeltaToolCall
from handlers.serving.tool_parsers import ParsedToolCall
from handlers.serving.tool_render import new_call_id

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
ANALYSIS_OPEN = f"{CHANNEL}analysis{MESSAGE}"
"""How the model opens its reasoning (the block `thinking_token_budget` caps)."""
FINAL_OPEN = f"{START}assistant{CHANNEL}final{MESSAGE}"
"""The header of the final answer: forced after the analysis at the budget."""
CALL, RETURN = "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)
"""What ends a message body (a ``<|start|>`` without an ``<|end|>`` starts the next)."""
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


def uses_harmony(flag: str | None, template: str | None, architecture: str) -> bool:
    """Whether outputs are parsed as harmony: ``--reasoning-parser harmony``, or (no
    flag) a gpt-oss model or a chat template that writes harmony channels."""
    if flag is not None:
        return flag == "harmony"
    return architecture == "GptOssForCausalLM" or CHANNEL in (template or "")


@dataclass(slots=True)
class HarmonyEvent:
    """One piece of parsed output: ``reasoning`` / ``content`` text, or a tool call's
    ``call_start`` (its `name`), ``call_args`` (argument text) and ``call_end``."""

    kind: str
    text: str = ""
    name: str = ""


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class HarmonyParser:
    """Harmony text in (any cut), events out. `tool_names`: the tools the request
    offered (None or empty: none, so every call stays content)."""

    def __init__(self, tool_names: set[str] | None) -> None:
        self._tool_names = tool_names or set()
        self._pending = ""
        self._in_body = False
        self._kind = "content"  # the open message's: reasoning, content or call
        self._plain = False  # the text is not harmony: all of it is content
        self._seen_header = False

    def feed(self, text: str) -> list[HarmonyEvent]:
        if self._plain:
            return [HarmonyEvent("content", text)] if text else []
        self._pending += text
        events: list[HarmonyEvent] = []
        while self._pending:
            if self._in_body:
                if not self._body(events):
                    break
            elif not self._header(events):
                break
        return events

    def finish(self) -> list[HarmonyEvent]:
        """The rest at the end of the output: an open body ends there (its terminator
        was the stop token); a header cut off before ``<|message|>`` is dropped, text
        that never was harmony is content."""
        pending, self._pending = self._pending, ""
        events: list[HarmonyEvent] = []
        if self._in_body:
            self._emit(events, pending)
            self._close(events)
        elif pending and (self._plain or "<|" not in pending):
            events.append(HarmonyEvent("content", pending))
        return events

    # -- states -----------------------------------------------------------------------
    def _header(self, events: list[HarmonyEvent]) -> bool:
        """Consume a header if it is complete; False when more text is needed."""
        pending = self._pending
        if not self._seen_header:
            stripped = pending.lstrip()
            if stripped and not (stripped.startswith("<|") or "<|".startswith(stripped)):
                self._plain = True  # not harmony: no header opens the output
                self._pending = ""
                events.append(HarmonyEvent("content", pending))
                return False
        end = pending.find(MESSAGE)
        if end < 0:
            return False
        header, self._pending = pending[:end], pending[end + len(MESSAGE) :]
        self._seen_header = True
        self._in_body = True
        self._kind = self._open(header, events)
        return True

    def _open(self, header: str, events: list[HarmonyEvent]) -> str:
        """The kind of the message `header` opens (emitting a call's start)."""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            target = recipient.group(1)
            name = target.removeprefix(FUNCTIONS)
            if target.startswith(FUNCTIONS) and name in self._tool_names:
                events.append(HarmonyEvent("call_start", name=name))
                return "call"
            if not target.startswith(FUNCTIONS):
                return "reasoning"  # a built-in tool hearth does not run
            return "content"  # a call to a tool that was not offered: its body stays text
        channel = _CHANNEL_NAME.search(header)
        return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _body(self, events: list[HarmonyEvent]) -> bool:
        """Emit body text up to a terminator (holding back a tail that may become one);
        False when more text is needed."""
        pending = self._pending
        ends = [(i, m) for m in _BODY_ENDS if (i := pending.find(m)) >= 0]
        if ends:
            i, marker = min(ends)
            self._emit(events, pending[:i])
            self._close(events)
            # A `<|start|>` belongs to the next header; the other terminators are spent.
            self._pending = pending[i:] if marker == START else pending[i + len(marker) :]
            return True
        keep = _held_tail(pending, _BODY_ENDS)
        self._emit(events, pending[: len(pending) - keep])
        self._pending = pending[len(pending) - keep :]
        return False

    def _emit(self, events: list[HarmonyEvent], text: str) -> None:
        if text:
            events.append(HarmonyEvent("call_args" if self._kind == "call" else self._kind, text))

    def _close(self, events: list[HarmonyEvent]) -> None:
        if self._kind == "call":
            events.append(HarmonyEvent("call_end"))
        self._in_body = False
        self._kind = "content"


@dataclass(slots=True)
class HarmonyOutput:
    reasoning: str | None
    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


def parse_harmony(text: str, tool_names: set[str] | None) -> HarmonyOutput:
    """A finished output's reasoning (None: none), content (None: empty) and calls (their
    arguments as the model wrote them)."""
    parser = HarmonyParser(tool_names)
    events = parser.feed(text) + parser.finish()
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls: list[ParsedToolCall] = []
    for event in events:
        if event.kind == "call_start":
            calls.append(ParsedToolCall(event.name, ""))
        elif event.kind == "call_args":
            calls[-1].arguments += event.text
    return HarmonyOutput(reasoning or None, content or None, calls)


class HarmonyStreamer:
    """One choice's harmony deltas as OpenAI delta fields: reasoning and content text as
    it comes, each call as a first fragment (index, id, name, arguments "") and then its
    argument text."""

    def __init__(self, tool_names: set[str] | None) -> None:
        self._parser = HarmonyParser(tool_names)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning, content, tool-call deltas) of one text delta."""
        return self._fields(self._parser.feed(text))

    def finish(self) -> tuple[str, str, list[DeltaToolCall]]:
        return self._fields(self._parser.finish())

    def _fields(self, events: list[HarmonyEvent]) -> tuple[str, str, list[DeltaToolCall]]:
        reasoning, content, calls = [], [], []
        for event in events:
            if event.kind == "reasoning":
                reasoning.append(event.text)
            elif event.kind == "content":
                content.append(event.text)
            elif event.kind == "call_start":
                self.num_calls += 1
                calls.append(
                    DeltaToolCall(
                        index=self.num_calls - 1,
                        id=new_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=event.name, arguments=""),
                    )
                )
            elif event.kind == "call_args":
                calls.append(
                    DeltaToolCall(
                        index=self.num_calls - 1, function=DeltaFunctionCall(arguments=event.text)
                    )
                )
        return "".join(reasoning), "".join(content), calls
