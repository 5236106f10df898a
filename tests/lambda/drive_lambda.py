"""Run the Lambda handler in a fresh process over stored events; print the responses.

A separate process because importing `container.lambda_handler` starts an engine core
thread and installs the event loop Mangum uses, exactly as in a Lambda sandbox.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class FakeContext:
    """The two attributes Mangum and our handler read from Lambda's context object."""

    aws_request_id = "test-invocation"

    def get_remaining_time_in_millis(self) -> int:
        return 300_000


def main(paths: list[str]) -> None:
    from container import lambda_handler

    engine = lambda_handler.engine
    # State right after import: the engine thread has started, but import did not wait
    # for the model (a Lambda init phase must stay short).
    results = {
        "after_import": {"started": engine._thread is not None, "ready": engine.is_ready()},
        "responses": {},
    }
    for path in paths:
        event = json.loads(Path(path).read_text())
        results["responses"][Path(path).stem] = lambda_handler.handler(event, FakeContext())
    results["after_invocations"] = {"ready": engine.is_ready()}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
