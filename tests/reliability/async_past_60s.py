"""A request that runs past SageMaker's 60 s real-time limit completes in async mode (a
script, not a test: it takes over two minutes of wall clock, so it is run by hand and its
figures quoted; the suite's test of the same rule uses a 1 s limit,
tests/e2e/test_sagemaker_sessions_batch.py).

Starts `serve` (the SageMaker entry, configuration in the environment only) twice with
the *default* real-time timeout (60 s, not the test override): once in real-time mode,
where the request is cut at 60 s with a 504, and once in async mode (what
`hearth deploy sagemaker --async` sets), where the same request runs ~70 s and
completes. The engine is slowed per step (`HEARTH_TEST_STEP_DELAY`) so the request is
long on any host while costing almost no CPU.

    PYTHONPATH=$PWD python tests/reliability/async_past_60s.py [--step-delay 0.5] [--tokens 140]

Exit code 0 when real-time cut it with a 504 and async completed it with every token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e.server import start_sagemaker_serve  # noqa: E402


def _run(mode: str, step_delay: float, tokens: int, log_dir: Path) -> tuple[int, float, dict]:
    env = {
        "SM_HEARTH_MAX_MODEL_LEN": "1024",
        "SM_HEARTH_KV_CACHE_MEMORY": "128MiB",
        "HEARTH_TEST_STEP_DELAY": str(step_delay),
        "HEARTH_SAGEMAKER_MODE": mode,
    }
    server = start_sagemaker_serve(log_dir / mode, env)
    try:
        request = {"prompt": "Tell me a long story.", "max_tokens": tokens, "ignore_eos": True}
        start = time.monotonic()
        answer = httpx.post(server.url + "/invocations", json=request, timeout=900)
        return answer.status_code, time.monotonic() - start, answer.json()
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-delay", type=float, default=0.5, help="seconds per engine step")
    parser.add_argument("--tokens", type=int, default=140, help="tokens to generate")
    args = parser.parse_args()
    print(
        f"request: {args.tokens} tokens at >= {args.step_delay} s a step "
        f"(>= {args.tokens * args.step_delay:.0f} s)",
        flush=True,
    )
    ok = True
    with tempfile.TemporaryDirectory(prefix="hearth-async-") as tmp:
        for mode in ("realtime", "async"):
            (Path(tmp) / mode).mkdir()
            status, elapsed, body = _run(mode, args.step_delay, args.tokens, Path(tmp))
            usage = body.get("usage", {}).get("completion_tokens")
            message = body.get("error", {}).get("message", "")
            print(
                f"{mode:>8}: HTTP {status} after {elapsed:.1f} s; completion_tokens={usage} "
                f"{message}",
                flush=True,
            )
            if mode == "realtime":
                ok &= status == 504 and elapsed < 75
            else:
                ok &= status == 200 and usage == args.tokens and elapsed > 60
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
