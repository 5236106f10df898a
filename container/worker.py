"""The gunicorn worker class: uvicorn-worker plus the graceful-shutdown window.

uvicorn-worker does not pass gunicorn's graceful_timeout to uvicorn, whose
`timeout_graceful_shutdown` then stays None. On SIGTERM uvicorn 0.54 closes its
listening socket, closes idle keep-alive connections, marks busy ones `keep_alive =
False` so that the response in progress (an SSE stream included) runs to its end, and
waits for them; with a window set, it cancels what is still running once the window is
over. We set the window 2 s short of gunicorn's graceful_timeout, so uvicorn ends the
leftovers itself (and runs the app's lifespan shutdown) before gunicorn's SIGKILL at
graceful_timeout; `hearth serve --timeout-graceful-shutdown` (default 20 s, inside
SageMaker's 30 s between SIGTERM and SIGKILL) sets both.
"""

from __future__ import annotations

from typing import Any

from uvicorn_worker import UvicornWorker

SIGKILL_MARGIN_S = 2


class HearthUvicornWorker(UvicornWorker):
    CONFIG_KWARGS: dict[str, Any] = {"loop": "auto", "http": "auto", "lifespan": "on"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Leave gunicorn's own SIGKILL a margin after uvicorn's deadline.
        self.config.timeout_graceful_shutdown = max(self.cfg.graceful_timeout - SIGKILL_MARGIN_S, 1)
