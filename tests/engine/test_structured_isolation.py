"""Issue 17, item 1, engine side: every grammar compile is bounded. Its time limit counts
from submission (a queued compile times out too), a request that goes cancels its
compile (queued: it never runs; running: its child process is killed), and the number of
pending compiles is capped (a 503). No timed assertion: each wait is a bounded poll."""

from __future__ import annotations

import contextlib
import json
import os
import time
from types import SimpleNamespace

import pytest

from engine.core_loop import handle_message
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams, StructuredOutputSpec
from engine.structured.manager import CompileQueueFull, StructuredOutputManager

pytestmark = pytest.mark.slow  # starts grammar child processes (xgrammar, ~3 s each)

SLOW = json.dumps({"type": "string", "maxLength": 10**8})
"""Within every size and depth cap, yet ~5 s (10^9: ~50 s) of xgrammar on this host."""


def _slow(i: int) -> StructuredOutputSpec:
    return StructuredOutputSpec(kind="json", value=SLOW.replace("}", f', "title": "t{i}"}}'))


def _wait(condition, what: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped is a zombie: count it as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


@pytest.fixture
def manager(model_smollm2_dir: str):
    m = StructuredOutputManager(model_smollm2_dir, 49152, [2], compile_timeout_s=600.0)
    assert m.isolate  # the default the engine runs with
    m.prewarm()
    for proc in m.processes:
        proc.start()
    _wait(lambda: m._compiler is not None, "the engine's own compiler built")
    yield m
    m.shutdown()


def test_a_queued_compile_times_out_from_submission_and_overruns_are_killed(manager) -> None:
    """Before, the limit counted from when a compile started: a compile queued behind
    two stuck ones never timed out, and the stuck ones ran on (threads cannot be
    stopped), holding both compile threads and two cores."""
    for i in range(3):  # two run, one waits behind them
        manager.submit(f"r{i}", _slow(i), payload=i)
    running = [manager._pending[f"r{i}"].future for i in range(2)]
    _wait(lambda: all(f.running() for f in running), "two compiles run")
    assert not manager._pending["r2"].future.running()
    manager.compile_timeout_s = 1.0  # all three were submitted over a second ago
    time.sleep(1.0)
    results: list = []
    _wait(lambda: results.extend(manager.ready()) or len(results) == 3, "all three timed out")
    assert sorted(r.payload for r in results) == [0, 1, 2]
    assert all(r.compiled is None and "took longer than 1 s" in r.error for r in results)
    # The running ones were stopped, not left to finish for nobody.
    _wait(lambda: manager._num_misses_pending == 0, "the slots are free again")
    assert sum(p.num_killed for p in manager.processes) == 2
    # And the next compile gets a fresh child.
    manager.compile_timeout_s = 600.0
    manager.submit("ok", StructuredOutputSpec(kind="regex", value="[a-z]{3}"), payload="ok")
    done: list = []
    _wait(lambda: done.extend(manager.ready()) or bool(done), "a normal compile after the kills")
    assert done[0].error is None and done[0].compiled is not None


def test_an_abort_stops_a_running_compile_and_drops_a_queued_one(manager) -> None:
    pids = [p.pid for p in manager.processes]
    for i in range(3):
        manager.submit(f"r{i}", _slow(i), payload=i)
    queued = manager._pending["r2"].future
    assert manager.discard("r2")
    assert queued.cancelled()  # it never runs
    # Both compiles hold a child (a compile cancelled before it took one never starts, and
    # leaves its child idle and alive: on a loaded host the second may lag the first).
    _wait(lambda: manager._slots.empty(), "both compiles hold a child")
    assert manager.discard("r0") and manager.discard("r1")
    _wait(lambda: not any(_alive(pid) for pid in pids), "both children killed")
    _wait(lambda: manager._num_misses_pending == 0, "the slots are free again")
    assert manager.ready() == [] and manager.num_pending == 0


def test_pending_compiles_are_capped_and_the_next_is_a_503(manager) -> None:
    manager.max_pending = 2
    manager.submit("a", _slow(1), payload=None)
    manager.submit("b", _slow(2), payload=None)
    with pytest.raises(CompileQueueFull):
        manager.submit("c", _slow(3), payload=None)
    # A cached grammar needs no compile and is never refused.
    manager.compile(StructuredOutputSpec(kind="regex", value="[0-9]+"))
    manager.submit("d", StructuredOutputSpec(kind="regex", value="[0-9]+"), payload=None)
    manager.discard("a")
    _wait(lambda: manager._num_misses_pending < 2, "a slot is free again")
    manager.submit("c", _slow(3), payload=None)


LOWEST_NICE = 19


def _thread_nice_values(pid: int) -> dict[int, int]:
    values = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread just ended
            values[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
    return values


def test_a_slow_compile_drops_to_nice_19_and_the_child_keeps_its_own(manager) -> None:
    """A compile past NICE_AFTER_CPU_S of CPU runs at nice 19, the lowest there is. At
    nice 10 (after 2 s), two slow legal schemas beside a decoding engine made an
    unconstrained client's chat p50 9.4x its quiet figure on a 2-vCPU host."""
    manager.submit("slow", _slow(0), payload=None)
    _wait(lambda: manager._slots.qsize() < len(manager.processes), "the compile holds a child")
    pids = [p.pid for p in manager.processes if p.pid is not None]

    def demoted() -> bool:
        return any(LOWEST_NICE in _thread_nice_values(pid).values() for pid in pids)

    _wait(demoted, "a thread of a compile child reached nice 19", limit_s=60.0)
    for pid in pids:  # the child itself (its main thread) keeps its nice value
        assert os.getpriority(os.PRIO_PROCESS, pid) < LOWEST_NICE
    assert manager.discard("slow")


def test_a_full_compile_queue_is_an_overloaded_admission() -> None:
    """The engine loop answers CompileQueueFull with the admission a full queue gets
    (the worker turns it into a 503), not an exception out of the loop."""

    def add_request(message, client_id):
        raise CompileQueueFull("The server is at capacity (64 constraints compiling)")

    sent: list = []
    core = SimpleNamespace(add_request=add_request)
    transport = SimpleNamespace(send=lambda client, message: sent.append((client, message)))
    msg = AddRequest(request_id="x", prompt_token_ids=[1], params=SamplingParams())
    handle_message(core, transport, b"w", msg)
    [(client, admission)] = sent
    assert client == b"w" and not admission.accepted
    assert admission.error_kind == "overloaded" and "capacity" in admission.message
