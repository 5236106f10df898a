"""`/tokenize` and `/detokenize` with the same template and tokenizer as generation."""

from __future__ import annotations

from typing import Any

from handlers.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from handlers.serving.chat_template import choose_chat_template
from handlers.serving.render import render_chat
from handlers.serving.served_model import ServedModel


class ServingTokenization:
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    async def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        served = self.served
        served.resolve_name(request.model)
        info = served.info()
        if isinstance(request, TokenizeChatRequest):
            text = await render_chat(served, request, choose_chat_template(served, request))
        else:
            text = request.prompt
        # NOTE: vLLM tokenizes texts of any length here; a text that cannot fit the
        # context is refused as for generation (a 6 MB one cost ~5 s of CPU each).
        param = "messages" if isinstance(request, TokenizeChatRequest) else "prompt"
        tokens = await served.encode(
            text, add_special_tokens=request.add_special_tokens, param=param
        )
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=info.max_model_len,
            tokens=tokens,
            token_strs=served.tokenizer().convert_ids_to_tokens(tokens)
            if request.return_token_strs
            else None,
        )

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's `/tokenizer_info`: tokenizer_config.json without its file paths, added
        tokens as their text, `tokenizer_class`, and the chat template this server
        renders with (--chat-template, else the model's)."""
        tokenizer = self.served.tokenizer()
        info = {
            key: _plain(value)
            for key, value in tokenizer.config.items()
            if not key.endswith("_file") and key != "added_tokens_decoder"
        }
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        template = self.served.config.chat_template or tokenizer.chat_template
        if template:
            info["chat_template"] = template
        return info

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        served = self.served
        served.resolve_name(request.model)
        served.info()
        served.check_token_ids(request.tokens, "tokens")
        # NOTE: special tokens are kept, so /detokenize inverts /tokenize (as in vLLM).
        text = served.tokenizer().decode(request.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)


def _plain(value: Any) -> Any:
    """An added token's text instead of its object (`{"content": ..., "__type": "AddedToken"}`)."""
    if isinstance(value, dict):
        if value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
