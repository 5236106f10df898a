"""Logprobs in OpenAI's two wire formats, from the engine's per-token `TokenLogprob`.

Chat: `logprobs.content[{token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}]`.
Completions: `logprobs{tokens, token_logprobs, top_logprobs[{token: logprob}], text_offset}`.
vLLM's `prompt_logprobs`: `[null, {token_id: {logprob, rank, decoded_token}}, ...]`.
A token's `token` is its own decoded text (a lone byte of a multi-byte character
decodes to U+FFFD, as in vLLM); `bytes` are its exact UTF-8 bytes where they can be
recovered (byte-level BPE and byte-fallback vocabularies), so clients can reassemble
characters split across tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

from engine.messages import TokenLogprob
from engine.tokenizer import Tokenizer
from handlers.protocol.base import PromptLogprob
from handlers.protocol.chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
)
from handlers.protocol.completion import CompletionLogProbs

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
MIN_LOGPROB = -9999.0
"""What -inf becomes on the wire (JSON has no infinity); vLLM's value."""


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for raw bytes, reversed."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class TokenTexts:
    """Per-token display text and bytes for one tokenizer, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute(token_id)
            if len(self._cache) < 200_000:
                self._cache[token_id] = cached
        return cached

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        piece = self._tokenizer.convert_ids_to_tokens([token_id])[0]
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return text, [int(fallback.group(1), 16)]
        decoder = _byte_level_decoder()
        if piece and all(c in decoder for c in piece):
            return text, [decoder[c] for c in piece]
        return text, list(text.encode("utf-8"))


class TokenIdTexts(TokenTexts):
    """vLLM's `return_tokens_as_token_ids`: every token is written `token_id:<id>` (its
    bytes those of that text), whatever it decodes to."""

    def __init__(self) -> None:
        pass

    def get(self, token_id: int) -> tuple[str, list[int]]:
        text = f"token_id:{token_id}"
        return text, list(text.encode("ascii"))


TOKEN_ID_TEXTS = TokenIdTexts()


def chat_logprobs(
    entries: list[TokenLogprob], texts: TokenTexts, num_top: int
) -> list[ChatCompletionLogProbsContent]:
    """Chat `logprobs.content` entries for these sampled tokens."""
    out: list[ChatCompletionLogProbsContent] = []
    for entry in entries:
        token, raw = texts.get(entry.token_id)
        top = [
            ChatCompletionLogProb(
                token=texts.text(tid), logprob=_finite(lp), bytes=texts.get(tid)[1]
            )
            for tid, lp in entry.top[:num_top]
        ]
        out.append(
            ChatCompletionLogProbsContent(
                token=token, logprob=_finite(entry.logprob), bytes=raw, top_logprobs=top
            )
        )
    return out


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    token_ids: list[int],
    texts: TokenTexts,
    num_top: int,
    text_offset: int,
) -> CompletionLogProbs:
    """Completion logprobs for these sampled tokens; offsets count from `text_offset`.

    `top_logprobs` holds the top k alternatives plus the sampled token (vLLM's shape).
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for i, token_id in enumerate(token_ids):
        token = texts.text(token_id)
        entry = entries[i] if i < len(entries) else None
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        top: dict[str, float] = {}
        for tid, lp in entry.top[:num_top]:
            top.setdefault(texts.text(tid), _finite(lp))
        top.setdefault(token, _finite(entry.logprob))
        top_logprobs.append(top)
    # NOTE: every field passed explicitly: chunks are serialized with exclude_unset.
    return CompletionLogProbs(
        text_offset=offsets,
        token_logprobs=token_logprobs,
        tokens=tokens,
        top_logprobs=top_logprobs,
    )


def prompt_logprobs(
    entries: list[TokenLogprob | None], texts: TokenTexts
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none: null), the token
    itself with its rank, then the top k with ranks 1..k, keyed by token id. A token
    that is also among the top k appears once, in the first place (vLLM builds the
    same dict)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {
            str(entry.token_id): PromptLogprob(
                logprob=_finite(entry.logprob),
                rank=entry.rank,
                decoded_token=texts.text(entry.token_id),
            )
        }
        for rank, (tid, lp) in enumerate(entry.top, start=1):
            position[str(tid)] = PromptLogprob(
                logprob=_finite(lp), rank=rank, decoded_token=texts.text(tid)
            )
        out.append(position)
    return out
