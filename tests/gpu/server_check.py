"""The real server on the check's device: ``hearth serve`` (gunicorn, 2 API workers, one
engine core process) answers a chat completion and a streamed one over HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.server import start_server

CHAT = {
    "messages": [{"role": "user", "content": "w10 w11 w12"}],
    "max_tokens": 8,
    "temperature": 0.0,
}


def chat_and_stream(model_dir: Path, device: str, work: Path) -> dict[str, Any]:
    flags = [str(model_dir), "--device", device, "--workers", "2", "--max-num-seqs", "16"]
    flags += ["--max-model-len", "512", "--served-model-name", "check"]
    if device == "cuda":
        flags += ["--gpu-memory-utilization", "0.3"]
    else:
        flags += ["--kv-cache-memory", "16MiB"]
    server = start_server(work, *flags)
    try:
        body = {"model": "check", **CHAT}
        chat = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)
        chunks: list[str] = []
        with httpx.stream(
            "POST", server.v1 + "/chat/completions", json={**body, "stream": True}, timeout=60
        ) as resp:
            stream_status = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: ") :])
        deltas = [
            c["choices"][0]["delta"].get("content") or ""
            for c in (json.loads(x) for x in chunks if x != "[DONE]")
            if c.get("choices")
        ]
        answer = chat.json()
        usage = answer.get("usage", {})
        ok = (
            chat.status_code == 200
            and usage.get("completion_tokens") == CHAT["max_tokens"]
            and stream_status == 200
            and chunks[-1:] == ["[DONE]"]
            and "".join(deltas) == answer["choices"][0]["message"]["content"]
        )
        return {
            "ok": ok,
            "chat_status": chat.status_code,
            "chat_usage": usage,
            "stream_status": stream_status,
            "stream_chunks": len(chunks),
            "stream_equals_chat": "".join(deltas) == answer["choices"][0]["message"]["content"],
            "chat_text": answer["choices"][0]["message"]["content"],
            "stream_text": "".join(deltas),
        }
    finally:
        code = server.stop()
        log_tail = server.log().splitlines()[-5:]
        print("\n".join(f"[server] {line}" for line in log_tail), flush=True)
        del code
