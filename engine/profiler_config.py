"""`--profiler-config` (vLLM's flag): which profiler `POST /start_profile` runs and where its
traces go. Apart from engine/profiler.py so that the configuration, which every process
reads, does not pull torch into the API workers."""

from __future__ import annotations

import argparse
import os
from typing import Literal

import msgspec

PROFILER_KINDS = ("torch",)
"""vLLM's `profiler` values hearth runs ('cuda' and 'proton' are refused by name)."""


class ProfilerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `--profiler-config` fields that apply to the torch profiler (same names)."""

    profiler: Literal["torch"] | None = None
    torch_profiler_dir: str = ""
    """Where traces go; absolute (vLLM's rule: the engine process may run elsewhere)."""
    torch_profiler_activities: list[Literal["CPU", "CUDA"]] | None = None
    """None: CPU, and CUDA on a GPU engine."""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    delay_iterations: int = 0
    """Steps to let pass after /start_profile before recording (vLLM's field)."""
    max_iterations: int = 0
    """Stop by itself after this many recorded steps; 0: only /stop_profile stops it."""


def parse_profiler_config(text: str) -> ProfilerConfig:
    """`--profiler-config`'s JSON, checked: an unknown key, a profiler other than torch or
    a relative directory is an error that names it."""
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError('give a JSON object, e.g. {"profiler": "torch", ...}')
    kind = raw.get("profiler")
    if kind is not None and kind not in PROFILER_KINDS:
        raise argparse.ArgumentTypeError(
            f"profiler {kind!r} is not supported; use 'torch' (CPU and CUDA activities)"
        )
    try:
        config = msgspec.convert(raw, ProfilerConfig)
    except msgspec.ValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if config.profiler is not None and not os.path.isabs(config.torch_profiler_dir):
        raise argparse.ArgumentTypeError(
            "torch_profiler_dir must be an absolute path (where the traces are written)"
        )
    if config.delay_iterations < 0 or config.max_iterations < 0:
        raise argparse.ArgumentTypeError("delay_iterations and max_iterations must be >= 0")
    return config
