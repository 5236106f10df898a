"""Chat messages to prompt text: one path for /v1/chat/completions and /tokenize, with
the template `handlers/serving/chat_template.py` chose."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.tokenizer import ChatTemplateError
from handlers.errors import BadRequestError
from handlers.serving.chat_template import ChatTemplateChoice, ChatTemplateRequest
from handlers.serving.served_model import ServedModel
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


async def render_chat(
    served: ServedModel,
    request: ChatTemplateRequest,
    template: ChatTemplateChoice,
    *,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """The prompt text (special tokens included as text) rendered with the request's
    chosen `template` (`choose_chat_template`); 400 when it cannot render.

    A template sent with the request (--trust-request-chat-template) renders in a thread,
    so even within its time and size limits it never stalls this worker's event loop."""
    if template.from_request:
        return await asyncio.to_thread(_render_chat, served, request, template, documents)
    return _render_chat(served, request, template, documents)


def template_variables(chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs` as template variables: the names the renderer
    sets itself (messages, tools, the special tokens, ...) are left out, not overridden."""
    return {
        k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS
    }


def _render_chat(
    served: ServedModel,
    request: ChatTemplateRequest,
    template: ChatTemplateChoice,
    documents: list[dict[str, str]] | None,
) -> str:
    kwargs = template_variables(request.chat_template_kwargs)
    if request.reasoning_effort is not None:  # vLLM's: a template variable
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    tokenizer = served.tokenizer()
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    if not template.renders_tools and needs_hermes_rendering(request.messages, request.tools):
        messages = hermes_messages(request.messages, request.tools)
        tools = None
    else:
        messages = [m.to_template() for m in request.messages]
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=template.source,
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
