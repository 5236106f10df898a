"""Run the Lambda handler in a fresh process over stored events; print the responses.

A separate process because importing `handlers.lambda_handler` starts an engine core
thread and installs the event loop Mangum uses, exactly as in a Lambda sandbox.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class FakeContext:
    """The two attributes Mangum and our handler read from Lambda's context object."""

    aws_request_id = "test-invocation"

    def get_remaining_time_in_millis(self) -> int:
        return 300_000


def main(paths: list[str]) -> None:
    start = time.monotonic()
    from handlers import lambda_handler

    init_s = time.monotonic() - start
    results = {"init_seconds": init_s, "responses": {}}
    for path in paths:
        event = json.loads(Path(path).read_text())
        results["responses"][Path(path).stem] = lambda_handler.handler(event, FakeContext())
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
