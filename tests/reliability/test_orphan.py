"""Issue 8, item 9: the engine core runs in its own session (so a terminal's Ctrl-C
cannot stop it before the workers drained); a SIGKILLed gunicorn master therefore left
it running forever. It now watches its parent and stops when the parent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, threading
from pathlib import Path
import engine.process as process
process.PARENT_CHECK_S = 0.05
stop = threading.Event()
process.watch_parent(stop)
Path(sys.argv[1]).write_text("armed")
stop.wait(60)
Path(sys.argv[1]).write_text("stopped" if stop.is_set() else "still running")
"""

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(120)
"""


def test_the_engine_stops_when_its_parent_is_killed(tmp_path: Path) -> None:
    status = tmp_path / "status"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(status)], cwd=ROOT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (status.exists() and status.read_text() == "armed"):
            assert time.monotonic() < deadline, "the child never started watching"
            time.sleep(0.05)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 30
        while status.read_text() == "armed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.read_text() == "stopped"
    finally:
        if parent.poll() is None:
            parent.kill()
