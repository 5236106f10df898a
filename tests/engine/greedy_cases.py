"""The chats whose greedy outputs the engine tests compare with transformers' `generate`
(the `prompts` and `reference` fixtures of tests/engine/conftest.py)."""

from __future__ import annotations

NEW_TOKENS = 24
SYSTEM = "You are a meticulous assistant who answers in one short paragraph. " * 6

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Quelle est la capitale de l'Allemagne ? Réponds en français."}],
    [{"role": "user", "content": "请用中文介绍一下长城。"}],
    [{"role": "user", "content": "Translate to Spanish: the cat sleeps on the warm windowsill 🐈"}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada! How can I help?"},
        {"role": "user", "content": "What is my name, and what is 12 times 12?"},
    ],
    [{"role": "user", "content": "def fib(n):\n    # complete this Python function\n"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why do cats purr?"}],
    [
        {
            "role": "user",
            "content": " ".join(f"Item {i}: a line of a long list." for i in range(34))
            + "\nSummarise the list above.",
        }
    ],
]
