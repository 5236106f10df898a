"""The torch profiler over engine steps, started and stopped by `POST /start_profile` and
`/stop_profile` (vLLM's routes, present only when `--profiler-config` names a profiler).

Why in the engine: the steps run in the engine core process, not in the API workers, so
the workers send a command and the engine profiles its own steps. `vllm bench serve
--profile` calls the two routes around its run; the trace it leaves is the one file a
kernel or scheduling question starts from. Traces are torch's Chrome/Perfetto JSON
(`torch.profiler.tensorboard_trace_handler`), one per profiling session, in
`torch_profiler_dir`, beside a text table of the ops by self time.
"""

from __future__ import annotations

import os
import time
from typing import Any

from engine.profiler_config import ProfilerConfig


class ProfilerError(Exception):
    """A start or stop that cannot be done now (already running, not running)."""


class StepProfiler:
    """One torch profiler session at a time, advanced once per engine step."""

    def __init__(self, config: ProfilerConfig, on_cuda: bool) -> None:
        self.config = config
        self.on_cuda = on_cuda
        self._profile: Any = None
        self._delay = 0
        self._left = 0
        self._prefix = "hearth"
        self.traces: list[str] = []
        """Files written so far (traces and their tables), for logs and tests."""

    @property
    def active(self) -> bool:
        return self._profile is not None or self._delay > 0

    def start(
        self,
        prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start a session (after `delay_iterations` steps); the request's overrides win
        over the config's, as in vLLM."""
        if self.active:
            raise ProfilerError("The profiler is already running; POST /stop_profile first.")
        self._prefix = _safe_prefix(prefix) if prefix else "hearth"
        delay = self.config.delay_iterations if delay_iterations is None else delay_iterations
        limit = self.config.max_iterations if max_iterations is None else max_iterations
        if delay < 0 or limit < 0:
            raise ProfilerError("delay_iterations and max_iterations must be >= 0")
        self._left = limit
        self._delay = delay
        if delay == 0:
            self._begin()

    def after_step(self) -> None:
        """Count one engine step: begin after the delay, stop after max_iterations."""
        if self._profile is not None:
            self._profile.step()
            if self._left:
                self._left -= 1
                if self._left == 0:
                    self.stop()
        elif self._delay > 0:
            self._delay -= 1
            if self._delay == 0:
                self._begin()

    def stop(self) -> list[str]:
        """End the session and write its files; the paths written."""
        if not self.active:
            raise ProfilerError("The profiler is not running; POST /start_profile first.")
        self._delay = 0
        profile, self._profile = self._profile, None
        if profile is None:  # stopped during the delay: nothing recorded
            return []
        before = set(os.listdir(self.config.torch_profiler_dir))
        profile.stop()  # the trace handler writes the trace here
        written = sorted(set(os.listdir(self.config.torch_profiler_dir)) - before)
        table = os.path.join(
            self.config.torch_profiler_dir, f"{self._prefix}_{os.getpid()}_{time.time_ns()}.txt"
        )
        with open(table, "w", encoding="utf-8") as out:
            out.write(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        paths = [os.path.join(self.config.torch_profiler_dir, name) for name in written] + [table]
        self.traces.extend(paths)
        return paths

    def _begin(self) -> None:
        import torch.profiler as tp

        config = self.config
        os.makedirs(config.torch_profiler_dir, exist_ok=True)
        names = config.torch_profiler_activities or (["CPU", "CUDA"] if self.on_cuda else ["CPU"])
        activities = [getattr(tp.ProfilerActivity, name) for name in names]
        self._profile = tp.profile(
            activities=activities,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            on_trace_ready=tp.tensorboard_trace_handler(
                config.torch_profiler_dir,
                worker_name=f"{self._prefix}_{os.getpid()}",
                use_gzip=config.torch_profiler_use_gzip,
            ),
        )
        self._profile.start()


def _safe_prefix(prefix: str) -> str:
    """The request's `profile_prefix` as a file-name part: no path separators or dots
    leading out of the directory."""
    kept = "".join(c if c.isalnum() or c in "-_" else "_" for c in prefix)[:64]
    return kept or "hearth"
