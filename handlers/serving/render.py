"""Chat messages to prompt text: one path for /v1/chat/completions and /tokenize."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from engine.tokenizer import ChatTemplateError
from handlers.errors import BadRequestError
from handlers.protocol.chat import ChatMessageParam, ChatToolParam
from handlers.serving.served_model import ServedModel
from handlers.serving.tool_parsers import detect_tool_format
from handlers.serving.tool_render import hermes_messages, needs_hermes_rendering

logger = logging.getLogger(__name__)

# Names the renderer passes itself; a chat_template_kwargs entry may not replace them
# (it would be a TypeError deep in the template call otherwise).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
    }
)


class ChatTemplateRequest(Protocol):
    """The fields a request renders through the chat template with: the chat request
    and the /tokenize chat request both have them, so both render the same way."""

    messages: list[ChatMessageParam]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    tools: list[ChatToolParam] | None


def tool_format(served: ServedModel, request: ChatTemplateRequest) -> str:
    """The tool-call format for this request: --tool-call-parser, else from the template."""
    if served.config.tool_call_parser:
        return served.config.tool_call_parser
    template = request.chat_template or served.config.chat_template
    return detect_tool_format(template or served.tokenizer().chat_template)[0]


async def render_chat(
    served: ServedModel,
    request: ChatTemplateRequest,
    *,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """The prompt text (special tokens included as text); 400 when it cannot render.

    A template sent with the request (--trust-request-chat-template) renders in a thread,
    so even within its time and size limits it never stalls this worker's event loop."""
    if request.chat_template is not None or (request.chat_template_kwargs or {}).get(
        "chat_template"
    ):
        return await asyncio.to_thread(_render_chat, served, request, documents)
    return _render_chat(served, request, documents)


def _render_chat(
    served: ServedModel,
    request: ChatTemplateRequest,
    documents: list[dict[str, str]] | None,
) -> str:
    kwargs = dict(request.chat_template_kwargs or {})
    requested_template = request.chat_template or kwargs.pop("chat_template", None)
    if requested_template is not None and not served.config.trust_request_chat_template:
        raise BadRequestError(
            "chat_template: a chat template was passed with the request, but the server "
            "does not trust request chat templates (--trust-request-chat-template).",
            param="chat_template",
        )
    if not isinstance(requested_template, (str, type(None))):
        raise BadRequestError("chat_template: must be a string", param="chat_template")
    kwargs = {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    template = requested_template or served.config.chat_template
    tokenizer = served.tokenizer()
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    _, template_knows_tools = detect_tool_format(template or tokenizer.chat_template)
    if not template_knows_tools and needs_hermes_rendering(request.messages, request.tools):
        messages = hermes_messages(request.messages, request.tools)
        tools = None
    else:
        messages = [m.to_template() for m in request.messages]
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=template,
            tools=tools,
            documents=documents,
            **kwargs,
        )
    except ChatTemplateError as exc:
        raise BadRequestError(f"messages: {exc}", param="messages") from None
    except RecursionError:
        raise BadRequestError(
            "messages: the chat template recursed too deeply", param="messages"
        ) from None
    except Exception as exc:
        # NOTE: templates raise TypeError and friends on messages they do not expect
        # (a None content, say); that is the request's fault, as in vLLM.
        logger.info("chat template failed: %r", exc)
        raise BadRequestError(
            f"messages: the chat template could not render these messages ({type(exc).__name__})",
            param="messages",
        ) from None
