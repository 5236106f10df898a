"""`<think>...</think>` reasoning, split off the answer into `reasoning_content`.

On when `--reasoning-parser think` is given, or (no flag) when the chat template mentions
`<think>` (DeepSeek-R1 distills, Qwen3, SmolLM3). Some templates open the `<think>` in the
prompt, so an output with a closing tag but no opening one is reasoning up to the tag.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def reasoning_enabled(flag: str | None, template: str | None) -> bool:
    if flag is not None:
        return flag == "think"
    return OPEN in (template or "")


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content); (None, text) when the text holds no think block."""
    start = text.find(OPEN)
    end = text.find(CLOSE)
    if end < 0:
        if start >= 0:  # cut off while still thinking
            return text[start + len(OPEN) :].strip(), ""
        return None, text
    begin = start + len(OPEN) if 0 <= start < end else 0
    return text[begin:end].strip(), text[end + len(CLOSE) :].lstrip()
