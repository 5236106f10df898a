"""The engine's operator commands (engine/core.py `control_command`) on a tiny random-weight
Llama: the prefix-cache reset with vLLM's semantics, and the torch profiler over steps
(engine/profiler.py) writing a real trace."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.messages import AddRequest, ControlCommand, RequestOutput
from engine.profiler_config import ProfilerConfig, parse_profiler_config
from engine.sampling_params import SamplingParams
from tests.engine.tiny_models import save_servable_tiny

PROMPT = list(range(5, 69))  # 64 tokens: four full blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_servable_tiny("llama-gqa-tied", directory)
    return directory


def make_core(model_dir: Path, profiler: ProfilerConfig | None = None):
    from engine.core import EngineCore

    config = EngineConfig(
        model=str(model_dir), max_model_len=256, num_threads=1, seed=0, profiler=profiler
    )
    return EngineCore(config, progress=lambda _: None)


def add(core, rid: str, prompt: list[int] = PROMPT) -> None:
    admission = core.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, params=GREEDY))
    assert admission is not None and admission.accepted


def run_to_end(core) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while core.has_work():
        for _, out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def control(core, op: str, **fields):
    return core.control_command(ControlCommand(call_id="c", op=op, **fields))


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def test_reset_forgets_cached_blocks(model_dir: Path) -> None:
    core = make_core(model_dir)
    add(core, "first")
    first = run_to_end(core)["first"]
    add(core, "warm")
    warm = run_to_end(core)["warm"]
    assert warm[0].num_cached_tokens == 48  # three full blocks (the last is recomputed)
    reply = control(core, "reset_prefix_cache")
    assert reply.ok and reply.error_kind is None
    add(core, "cold")
    cold = run_to_end(core)["cold"]
    assert cold[0].num_cached_tokens == 0
    assert tokens(first) == tokens(warm) == tokens(cold)


def test_reset_is_refused_while_requests_run_unless_they_are_preempted(model_dir: Path) -> None:
    """vLLM's rule: success false while running requests hold blocks; with
    reset_running_requests they are preempted, the cache emptied, and they finish with
    the tokens an undisturbed run gives (they recompute from their tokens so far)."""
    core = make_core(model_dir)
    add(core, "alone")
    alone = tokens(run_to_end(core)["alone"])
    control(core, "reset_prefix_cache")
    add(core, "busy")
    outs: list[RequestOutput] = []
    for _ in range(3):  # prefill and two decode steps
        outs += [out for _, out in core.step()]
    assert core.scheduler.num_running == 1
    refused = control(core, "reset_prefix_cache")
    assert not refused.ok and refused.error_kind is None
    assert core.block_manager.num_used_blocks > 0
    reset = control(core, "reset_prefix_cache", reset_running_requests=True)
    assert reset.ok
    assert core.scheduler.num_running == 0 and core.scheduler.num_waiting == 1
    assert core.block_manager.num_used_blocks == 0 and core.scheduler.num_preemptions == 1
    outs += run_to_end(core)["busy"]
    assert tokens(outs) == alone and outs[-1].finish_reason == "length"
    assert core.block_manager.num_used_blocks == 0


def test_profiler_writes_a_trace_of_the_steps(model_dir: Path, tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    core = make_core(model_dir, ProfilerConfig(profiler="torch", torch_profiler_dir=str(trace_dir)))
    stopped = control(core, "stop_profile")
    assert not stopped.ok and "not running" in (stopped.message or "")
    assert control(core, "start_profile", profile_prefix="../run one").ok
    again = control(core, "start_profile")
    assert not again.ok and "already running" in (again.message or "")
    add(core, "profiled")
    run_to_end(core)
    reply = control(core, "stop_profile")
    assert reply.ok and len(reply.files) == 2
    trace = next(Path(f) for f in reply.files if f.endswith(".json.gz"))
    table = next(Path(f) for f in reply.files if f.endswith(".txt"))
    assert trace.parent == table.parent == trace_dir  # the prefix cannot leave the dir
    assert trace.name.startswith("___run_one_")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {event.get("name", "") for event in events}
    assert any(name.startswith("aten::") for name in names)
    assert "aten::" in table.read_text()


def test_profiler_delay_and_max_iterations(model_dir: Path, tmp_path: Path) -> None:
    core = make_core(
        model_dir,
        ProfilerConfig(
            profiler="torch", torch_profiler_dir=str(tmp_path), torch_profiler_use_gzip=False
        ),
    )
    assert control(core, "start_profile", delay_iterations=2, max_iterations=3).ok
    add(core, "r")
    core.step()
    core.step()
    assert core.profiler is not None and core.profiler.active and not core.profiler.traces
    for _ in range(3):
        core.step()
    assert not core.profiler.active  # stopped by itself after three recorded steps
    assert any(path.endswith(".json") for path in core.profiler.traces)
    run_to_end(core)


def test_without_a_profiler_the_commands_say_how_to_get_one(model_dir: Path) -> None:
    core = make_core(model_dir)
    reply = control(core, "start_profile")
    assert not reply.ok and reply.error_kind == "invalid"
    assert "--profiler-config" in (reply.message or "")
    unknown = control(core, "sleep")
    assert not unknown.ok and "unknown control operation" in (unknown.message or "")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"profiler": "cuda", "torch_profiler_dir": "/t"}', "'cuda' is not supported"),
        ('{"profiler": "torch", "torch_profiler_dir": "rel"}', "absolute"),
        ('{"profiler": "torch", "torch_profiler_dir": "/t", "nope": 1}', "nope"),
        ('{"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": -1}', ">= 0"),
    ],
)
def test_profiler_config_errors_name_the_problem(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse_profiler_config(text)


def test_profiler_config_reads_vllms_fields() -> None:
    config = parse_profiler_config(
        '{"profiler": "torch", "torch_profiler_dir": "/tmp/x", "torch_profiler_with_stack": false,'
        ' "torch_profiler_record_shapes": true}'
    )
    assert config.torch_profiler_dir == "/tmp/x" and not config.torch_profiler_with_stack
    assert config.torch_profiler_record_shapes and config.torch_profiler_use_gzip
