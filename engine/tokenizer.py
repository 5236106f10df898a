"""Tokenizer, chat template rendering and incremental detokenization for API workers.

Built on the `tokenizers` library and jinja2 directly rather than transformers'
AutoTokenizer: importing transformers' tokenizer stack pulls in torch (about 300 MB
of RSS per API worker and seconds of start-up), and API workers never touch tensors.
The chat template environment mirrors transformers' (sandboxed, trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a non-ASCII `tojson`)
so templates written for HF render the same here.
"""

from __future__ import annotations

import functools
import json
import operator
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (400 for the client)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MAX_RENDERED_CHARS = 4 << 20
"""A rendered prompt (or any string a template builds) longer than this is refused; the
largest context we serve is far below it in characters."""
RENDER_TIME_LIMIT_S = 2.0
"""CPU time one rendering may take; real chat templates take well under a millisecond."""
_MAX_POWER_EXPONENT = 1024

_render_deadline = threading.local()


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A template went past a size or time limit."""


def _check_deadline() -> None:
    deadline = getattr(_render_deadline, "at", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimitError(f"the chat template ran longer than {RENDER_TIME_LIMIT_S:g} s")


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


class _GuardedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's sandbox plus limits on what a request's template can do to a worker:
    `*` and `+` may not build huge strings or lists, `**` may not build huge numbers,
    and calls, attribute lookups and operators check a render deadline (so a loop that
    does anything at all stops in time)."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if op == "*":
            for seq, count in ((left, right), (right, left)):
                size = _sized(seq)
                if (
                    size is not None
                    and isinstance(count, int)
                    and size * count > MAX_RENDERED_CHARS
                ):
                    raise TemplateLimitError("the chat template builds a value that is too large")
            return operator.mul(left, right)
        if op == "**":
            if isinstance(right, (int, float)) and abs(right) > _MAX_POWER_EXPONENT:
                raise TemplateLimitError("the chat template raises to a power that is too large")
            return operator.pow(left, right)
        if op == "+":
            sizes = (_sized(left), _sized(right))
            if None not in sizes and sum(sizes) > MAX_RENDERED_CHARS:  # type: ignore[arg-type]
                raise TemplateLimitError("the chat template builds a value that is too large")
            return operator.add(left, right)
        return super().call_binop(context, op, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Every `{% for %}` iterates through `_guard_iter`, which checks the deadline:
        a loop whose body does nothing checked (nested loops over a literal) ran 10^8
        iterations, 2.55 s, before the error; 10^12 would have held the GIL for hours."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(
                nodes.Name(_GUARD_ITER, "load"), [loop.iter], [], None, None, lineno=loop.lineno
            )
        return tree


_GUARD_ITER = "__hearth_guard_iter"
_ITERATIONS_PER_CHECK = 256


def _guard_iter(iterable: Any) -> Any:
    _check_deadline()
    if isinstance(iterable, jinja2.Undefined):
        return iterable  # jinja's own error (or empty loop) for an undefined name
    return _guarded(iterable)


def _guarded(iterable: Any) -> Any:
    for i, item in enumerate(iterable):
        if i % _ITERATIONS_PER_CHECK == 0:
            _check_deadline()
        yield item


def _render_bounded(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render piece by piece under the size cap and the deadline."""
    _render_deadline.at = time.monotonic() + RENDER_TIME_LIMIT_S
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise TemplateLimitError(
                    f"the rendered prompt exceeds {MAX_RENDERED_CHARS} characters"
                )
            _check_deadline()
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _render_deadline.at = None


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = _GuardedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals[_GUARD_ITER] = _guard_iter
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas, one token at a time.

    Multi-byte characters split across tokens (emoji, CJK, byte-fallback) are held
    back until complete, so a delta is always valid UTF-8 text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""

    def steps(self, token_ids: list[int]) -> str:
        return "".join(self.step(t) for t in token_ids)


class Tokenizer:
    """A model directory's tokenizer: encode, decode, chat template, special tokens."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} is missing: hearth needs a fast tokenizer (tokenizer.json) "
                "in the model directory."
            )
        self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        self.config: dict[str, Any] = config
        """tokenizer_config.json as read (vLLM's /tokenizer_info answers with it)."""
        generation = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")

        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(config.get(key))
            if content:
                self.special_tokens[key] = content
        self.all_special_ids: frozenset[int] = frozenset(
            token_id
            for token_id, added in self._tok.get_added_tokens_decoder().items()
            if added.special
        )
        self.eos_token_ids: list[int] = _eos_ids(self, generation, model_config)
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None

        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template: str | None = template_file.read_text()
        else:
            template = config.get("chat_template")
            self.chat_template = template if isinstance(template, str) else None

    # -- vocabulary ---------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    # -- text <-> ids -------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, through `encode_batch`, which releases the GIL while it works (for
        a thread: `encode` holds it, so a 6 MB text froze its caller's event loop ~5 s;
        the same text through this stalls the loop ~0.04 s)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_truncated(
        self,
        text: str,
        max_length: int,
        side: str = "left",
        add_special_tokens: bool = True,
        release_gil: bool = False,
        head: int | None = None,
    ) -> tuple[list[int], bool]:
        """The ids of `text` cut to at most `max_length` (vLLM's `truncate_prompt_tokens`
        and `truncation_side`: transformers' `truncation=True, max_length`): side "left"
        keeps the text's last tokens, "right" its first; the special tokens the tokenizer
        adds (a BOS) stay, counted in `max_length`. Also whether any token was cut.
        `head`: first keep only the text's first `head` tokens, special tokens not counted
        (vLLM's `max_tokens_per_query` / `max_tokens_per_doc` of the score APIs).
        `release_gil`: encode through `encode_batch`, as `encode_releasing_gil` does."""
        if release_gil:
            encoding = self._tok.encode_batch([text], add_special_tokens=False)[0]
        else:
            encoding = self._tok.encode(text, add_special_tokens=False)
        cut = False
        if head is not None and len(encoding.ids) > head:
            encoding.truncate(head, direction="right")
            cut = True
        specials = self._tok.num_special_tokens_to_add(False) if add_special_tokens else 0
        room = max(max_length - specials, 0)
        cut = cut or len(encoding.ids) > room
        encoding.truncate(room, direction=side)
        if add_special_tokens:
            encoding = self._tok.post_process(encoding, add_special_tokens=True)
        return encoding.ids, cut

    def leading_text(self, text: str, max_tokens: int, release_gil: bool = False) -> str:
        """The start of `text` that holds at most `max_tokens` tokens (special tokens not
        counted), cut at a token boundary of the original characters: vLLM's
        `truncate_text_to_tokens` for a cross-encoder's query and document, which are
        cut as text before the pair is composed. Re-tokenizing a cut text can merge
        differently, so it is checked again (a few rounds, then the kept ids decoded).
        `release_gil`: encode through `encode_batch`, as `encode_releasing_gil` does."""
        for _ in range(8):
            if release_gil:
                encoding = self._tok.encode_batch([text], add_special_tokens=False)[0]
            else:
                encoding = self._tok.encode(text, add_special_tokens=False)
            if len(encoding.ids) <= max_tokens:
                return text
            if max_tokens <= 0:
                return ""
            offsets = encoding.offsets
            end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
            text = text[: min(end, len(text) - 1)]
        return self.decode(encoding.ids[:max_tokens])

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's length in UTF-8 bytes (of its vocabulary string: for a
        byte-level vocabulary one character per byte, so never less than the bytes, and
        never less than the characters of text one token can stand for). A text longer
        than max_model_len times this has more tokens than fit."""
        return max((len(t.encode("utf-8")) for t in self._tok.get_vocab(True)), default=1)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    # -- chat ----------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to the prompt text (special tokens as text; encode it without
        adding special tokens again). Raises ChatTemplateError on a template error.

        The request's flags are validated by their owner, the wire schema
        (`handlers/protocol/chat.py` `check_template_flags`), before they get here.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ChatTemplateError(
                "This model has no chat template; pass one with --chat-template, "
                "or use /v1/completions."
            )
        try:
            template = _compile_template(source)
            rendered = _render_bounded(
                template,
                {
                    "messages": messages,
                    "tools": tools,
                    "documents": documents,
                    "add_generation_prompt": add_generation_prompt,
                    **self.special_tokens,
                    **kwargs,
                },
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"Chat template error: {exc}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """Drop whatever the template appended after the last message's content (its
    end-of-turn tokens), so generation continues that message."""
    if not messages:
        return rendered
    content = messages[-1].get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    content = (content or "").strip()
    if not content:
        return rendered
    index = rendered.rfind(content)
    if index < 0:
        raise ChatTemplateError("continue_final_message: the final message was not rendered.")
    return rendered[: index + len(content)]


def _eos_ids(
    tokenizer: Tokenizer, generation: dict[str, Any], model_config: dict[str, Any]
) -> list[int]:
    for source in (generation, model_config):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value:
            return [int(v) for v in value]
    eos = tokenizer.special_tokens.get("eos_token")
    token_id = tokenizer.token_to_id(eos) if eos else None
    return [token_id] if token_id is not None else []


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
