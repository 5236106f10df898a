"""`/tokenize` and `/detokenize` with the same template and tokenizer as generation."""

from __future__ import annotations

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

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        served = self.served
        served.resolve_name(request.model)
        served.info()
        served.check_token_ids(request.tokens, "tokens")
        # NOTE: special tokens are kept, so /detokenize inverts /tokenize (as in vLLM).
        text = served.tokenizer().decode(request.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
