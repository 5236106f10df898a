"""A run over several servers, one at a time: hearth, vLLM at each dtype, hearth again.

Two servers on one two-core host would measure each other, so a session starts each server
only for its own pass and stops it (and everything it spawned) before the next one starts.
The sandwich order (hearth, baselines, hearth) makes host drift visible: if the two hearth
passes disagree, so would any ratio taken from one of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from container.bench.server import Log, ServerStartError, SpawnedServer, free_port
from container.bench.stats import Result

SUBJECT, BASELINE = "subject", "baseline"


@dataclass(frozen=True)
class ServerPlan:
    """One pass of a session: a server already running (`base_url`) or one to start."""

    label: str
    role: str = SUBJECT  # SUBJECT: the server under test; BASELINE: what it is compared with
    kind: str = "hearth"  # "hearth", "vllm" or "url": recorded, never interpreted
    base_url: str | None = None
    # Given a free port, the command that starts the server; None for a running one.
    command: Callable[[int], list[str]] | None = None
    env: Mapping[str, str] | None = None
    ready_path: str = "/ping"
    extra: Mapping[str, object] = field(default_factory=dict)  # e.g. {"dtype": "bfloat16"}


# What measures one server: (its base URL, its plan, the pass index) -> its result.
Measure = Callable[[str, ServerPlan, int], Result]


def sandwich(subject: ServerPlan, baselines: Sequence[ServerPlan], again: bool) -> list[ServerPlan]:
    """The order of a session: subject, baselines, and with `again` the subject once more.

    The two subject passes are labelled `<label>-1` and `<label>-2`.
    """
    if not again:
        return [subject, *baselines]
    first = replace(subject, label=f"{subject.label}-1")
    return [first, *baselines, replace(subject, label=f"{subject.label}-2")]


def _load_average() -> float | None:
    """The 1-minute load average: other work on the host skews a pass's figures."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_session(
    plans: Sequence[ServerPlan],
    measure: Measure,
    output_dir: str | Path,
    ready_timeout_s: float,
    log: Log,
) -> tuple[list[Result], str | None]:
    """Measure each plan in turn; never two spawned servers alive at once.

    Returns the results so far and, when a server could not be started, why (the session
    stops there: later passes would no longer form the order asked for).
    """
    results: list[Result] = []
    for index, plan in enumerate(plans):
        log(f"[{index + 1}/{len(plans)}] {plan.label}")
        info: Result = {"label": plan.label, "role": plan.role, "kind": plan.kind, **plan.extra}
        info["loadavg_at_start"] = _load_average()
        if plan.command is None:
            assert plan.base_url is not None, "a plan needs a base_url or a command"
            result = measure(plan.base_url, plan, index)
        else:
            port = free_port()
            command = plan.command(port)
            log_path = Path(output_dir) / f"server-{plan.label}.log"
            server = SpawnedServer(
                command,
                port,
                log_path,
                ready_timeout_s,
                log=log,
                ready_path=plan.ready_path,
                env=plan.env,
            )
            try:
                with server as url:
                    result = measure(url, plan, index)
            except ServerStartError as exc:
                return results, f"{plan.label}: {exc}"
            info.update(command=command, ready_s=server.ready_s)
        result["server"] = info
        results.append(result)
    return results, None
