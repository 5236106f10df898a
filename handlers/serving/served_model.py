"""The one model this server serves, as the serving classes see it.

Shared by every serving class of a worker: the names a request may use, the engine's
`ModelInfo` (known once the engine is warm), the tokenizer (loaded once, lazily, from
the directory the engine reports when the config names none) and the default
sampling parameters of the model's generation_config.json.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.client import EngineClient
from engine.config import ModelInfo
from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig
from handlers.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from handlers.protocol.base import TruncationSide
from handlers.protocol.sampling import GENERATION_CONFIG_DEFAULTS, check_in_vocabulary
from handlers.serving.harmony import ANALYSIS_OPEN as HARMONY_ANALYSIS
from handlers.serving.harmony import END as HARMONY_END
from handlers.serving.harmony import FINAL_OPEN as HARMONY_FINAL
from handlers.serving.logprobs import TOKEN_ID_TEXTS, TokenTexts
from handlers.serving.reasoning import CLOSE as THINK_CLOSE
from handlers.serving.reasoning import OPEN as THINK_OPEN

logger = logging.getLogger(__name__)

_THREAD_ENCODE_CHARS = 32_768
"""Texts longer than this are tokenized in a thread so the event loop keeps streaming;
so are all the texts of a batch longer than this in all (`offload`: 190 texts of 32 KB,
each under the threshold, took ~5 s of one worker's loop inline)."""


def offloads(texts: SequenceT[str | list[int]]) -> bool:
    """Whether a batch's texts are long enough in all to tokenize off the event loop."""
    return sum(len(t) for t in texts if isinstance(t, str)) > _THREAD_ENCODE_CHARS


@dataclass(frozen=True, slots=True)
class Truncation:
    """How much of a prompt to keep (`ServedModel.truncation`): `size` tokens from the
    end ("left": the first ones are dropped, vLLM's default) or from the start ("right");
    before that, with `head`, only the text's first `head` tokens (special tokens not
    counted: the score APIs' `max_tokens_per_query` / `max_tokens_per_doc`)."""

    size: int
    side: TruncationSide
    head: int | None = None

    def of(self, token_ids: list[int]) -> list[int]:
        """The kept part of a prompt given as token ids."""
        if self.head is not None:
            token_ids = token_ids[: self.head]
        return token_ids[-self.size :] if self.side == "left" else token_ids[: self.size]


class ServedModel:
    """Names, engine, tokenizer and defaults of the served model."""

    def __init__(
        self, config: ServerConfig, engine: EngineClient, tokenizer: Tokenizer | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self._tokenizer = tokenizer
        self._token_texts: TokenTexts | None = None
        self._reasoning_block_ids: dict[bool, tuple[list[int], list[int], list[int]]] = {}
        self._defaults: dict[str, Any] | None = None
        self.limits = config.request_limits()

    # -- names ------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return self.config.served_model_names

    def resolve_name(self, requested: str | None) -> str:
        """The name to report; 404 for a name this server does not serve."""
        if not requested:
            return self.config.default_model_name
        if requested in self.config.served_model_names:
            return requested
        if self.config.enable_lora:
            return requested  # an adapter's name: the engine knows whether it exists
        raise NotFoundError(f"The model `{requested}` does not exist.", param="model")

    def adapter_for(self, name: str) -> str | None:
        """The LoRA adapter a resolved name runs on; None for the base model."""
        return None if name in self.config.served_model_names or not name else name

    # -- engine facts -----------------------------------------------------------------
    def info(self) -> ModelInfo:
        """The engine's ModelInfo; 503 while it is loading or once it is dead."""
        if self.engine.is_dead():
            raise ServiceUnavailableError("The engine has stopped; the server is restarting.")
        info = self.engine.model_info
        if info is None:
            raise ServiceUnavailableError("The model is still loading; retry shortly.")
        return info

    @property
    def model_dir(self) -> str:
        return self.config.model_dir or self.info().model_dir

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_dir)
        return self._tokenizer

    def token_texts(self, as_token_ids: bool = False) -> TokenTexts:
        """How logprob tokens are written: decoded (cached per token), or `token_id:<id>`
        (`as_token_ids`: vLLM's `return_tokens_as_token_ids`)."""
        if as_token_ids:
            return TOKEN_ID_TEXTS
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer())
        return self._token_texts

    def vocab_size(self) -> int:
        """Ids the model can take: the engine's embedding size, or the tokenizer's."""
        info = self.engine.model_info
        return info.vocab_size if info is not None else self.tokenizer().vocab_size

    def sampling_defaults(self) -> dict[str, Any]:
        """vLLM's `--generation-config auto`: the model's own sampling defaults."""
        if self._defaults is None:
            self._defaults = {}
            if self.config.generation_config == "auto":
                self._defaults = _read_generation_defaults(Path(self.model_dir))
        return self._defaults

    # -- token helpers ----------------------------------------------------------------
    async def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        param: str | None = None,
        offload: bool = False,
    ) -> list[int]:
        """Token ids of a text. With `param` (a prompt), a text too long to fit the
        context is refused before it is tokenized; a long text (or any, with `offload`:
        one of a batch that is long in all) is tokenized on a thread with the GIL
        released, so the event loop keeps serving meanwhile."""
        tokenizer = self.tokenizer()
        if param is not None:
            self.check_text_fits(text, param)
        if offload or len(text) > _THREAD_ENCODE_CHARS:
            return await asyncio.to_thread(tokenizer.encode_releasing_gil, text, add_special_tokens)
        return tokenizer.encode(text, add_special_tokens)

    def reasoning_block_ids(self, harmony: bool) -> tuple[list[int], list[int], list[int]]:
        """A reasoning block's token ids, for `thinking_token_budget`: its opening tag,
        its closing tag, and what is forced at the budget (`<think>`, `</think>`, the
        closing tag; harmony: `<|channel|>analysis<|message|>`, `<|end|>`, the end and the
        final answer's header). Tokenized once per kind: they depend on the tokenizer
        alone."""
        ids = self._reasoning_block_ids.get(harmony)
        if ids is None:
            tokenizer = self.tokenizer()

            def encode(text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False)

            if harmony:
                end = encode(HARMONY_END)
                ids = (encode(HARMONY_ANALYSIS), end, encode(HARMONY_END + HARMONY_FINAL))
            else:
                ids = (encode(THINK_OPEN), encode(THINK_CLOSE), [])
            self._reasoning_block_ids[harmony] = ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of a short text (a bad word), without special tokens, on the
        caller's thread (the text's length is capped by the request schema)."""
        return self.tokenizer().encode(text, add_special_tokens=False)

    async def encode_prompt(
        self,
        text: str,
        truncation: Truncation | None,
        *,
        add_special_tokens: bool,
        param: str,
        offload: bool = False,
    ) -> tuple[list[int], bool]:
        """A prompt's ids, and whether `truncation` cut any (without one: `encode`, a
        text too long to fit refused before it is tokenized). With one, only
        `truncation.size` tokens from its side are kept, and a text too long to fit is
        not refused: it is first cut to max_model_len x `max_token_bytes` characters on
        the side truncation drops, so a truncated prompt costs no more than the longest
        prompt that fits. That cut can change only the tokens at it, which are further
        than `size` tokens from the kept end (the characters kept hold at least
        max_model_len tokens)."""
        if truncation is None:
            return await self.encode(
                text, add_special_tokens=add_special_tokens, param=param, offload=offload
            ), False
        tokenizer = self.tokenizer()
        max_model_len = self.info().max_model_len
        bound = max_model_len * tokenizer.max_token_bytes
        if truncation.head is not None:
            # Only the text's first `head` tokens can be kept, and they lie in its first
            # head x max_token_bytes characters.
            part = text[: min(truncation.head, max_model_len) * tokenizer.max_token_bytes]
        else:
            part = text[-bound:] if truncation.side == "left" else text[:bound]
        encode = functools.partial(
            tokenizer.encode_truncated,
            part,
            truncation.size,
            truncation.side,
            add_special_tokens,
            head=truncation.head,
        )
        if offload or len(part) > _THREAD_ENCODE_CHARS:
            ids, cut = await asyncio.to_thread(encode, release_gil=True)
        else:
            ids, cut = encode()
        return ids, cut or len(part) < len(text)

    async def leading_text(self, text: str, max_tokens: int, *, offload: bool = False) -> str:
        """`Tokenizer.leading_text`, on a thread when long (or with `offload`); only the
        first max_tokens x max_token_bytes characters can be kept, so only they are
        tokenized."""
        tokenizer = self.tokenizer()
        part = text[: max_tokens * tokenizer.max_token_bytes]
        if offload or len(part) > _THREAD_ENCODE_CHARS:
            return await asyncio.to_thread(tokenizer.leading_text, part, max_tokens, True)
        return tokenizer.leading_text(part, max_tokens)

    def truncation(
        self,
        truncate_prompt_tokens: int | None,
        side: TruncationSide | None = None,
        param: str = "truncate_prompt_tokens",
    ) -> Truncation | None:
        """vLLM's `truncate_prompt_tokens` (TGI's `truncate`) and `truncation_side`:
        keep k tokens of a prompt, its last (side "left", the default) or its first
        ("right"); -1 means the context length; more than the context length is a 400
        (vLLM's message), reported against `param`."""
        if truncate_prompt_tokens is None:
            return None
        max_model_len = self.info().max_model_len
        if truncate_prompt_tokens > max_model_len:
            raise BadRequestError(
                f"{param} value ({truncate_prompt_tokens}) is greater than "
                f"max_model_len ({max_model_len}). Please, select a smaller truncation size.",
                param=param,
            )
        size = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return Truncation(size, side or "left")

    def check_text_fits(self, text: str, param: str) -> None:
        """No token stands for more than `max_token_bytes` characters, so a longer text
        than max_model_len times that cannot fit: refused without tokenizing it."""
        max_model_len = self.info().max_model_len
        per_token = self.tokenizer().max_token_bytes
        if len(text) > max_model_len * per_token:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has more than {max_model_len} input tokens ({len(text)} "
                f"characters, at most {per_token} per token). Please reduce the length of "
                "the input.",
                param=param,
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        check_in_vocabulary(token_ids, self.vocab_size(), param)

    def check_prompt_len(self, num_tokens: int, param: str) -> None:
        """vLLM's rule: a prompt must leave room for at least one generated token."""
        max_model_len = self.info().max_model_len
        if num_tokens == 0:
            raise BadRequestError(f"{param}: the prompt is empty after tokenization", param=param)
        if num_tokens >= max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {num_tokens} input tokens. Please reduce the length of "
                f"the input.",
                param=param,
            )

    def check_input_len(self, num_tokens: int, param: str) -> None:
        """An embedding input generates nothing, so it may fill the whole context."""
        max_model_len = self.info().max_model_len
        if num_tokens == 0:
            raise BadRequestError(f"{param}: the input is empty after tokenization", param=param)
        if num_tokens > max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {num_tokens} tokens in the input for embedding generation. "
                "Please reduce the length of the input.",
                param=param,
            )

    def log_prompt(self, request_id: str, prompt: str | list[int]) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            shown = prompt if isinstance(prompt, str) else str(prompt)
            limit = self.config.max_log_len
            if limit is not None:
                shown = shown[:limit]
            logger.debug("request %s prompt: %r", request_id, shown)


def _read_generation_defaults(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    defaults: dict[str, Any] = {
        name: data[name]
        for name in GENERATION_CONFIG_DEFAULTS
        if isinstance(data.get(name), (int, float)) and not isinstance(data.get(name), bool)
    }
    if isinstance(data.get("max_new_tokens"), int):
        defaults["max_tokens"] = data["max_new_tokens"]
    if defaults:
        logger.info("default sampling parameters from %s: %s", path, defaults)
    return defaults
