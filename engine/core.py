"""The engine core: admission, scheduling, one forward per step, token-level stops.

`EngineCore` is transport-free: `add_request`, `abort` and `step` are plain calls. The
busy loop in `engine/core_loop.py` drives it from ZeroMQ (own process) or from a
thread (in-process mode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelInfo
from engine.messages import AddRequest, Admission, RequestOutput
from engine.model_loader import load_model, resolve_model_dir
from engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

logger = logging.getLogger("hearth.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU matmuls are fastest and exact in fp32 here; GPUs want bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown --dtype {name!r}: use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


class EngineCore:
    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda msg: logger.info("%s", msg))
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.seed is not None:
            torch.manual_seed(config.seed)

        model_dir = resolve_model_dir(config.model, progress=say)
        start = time.monotonic()
        say(f"loading {model_dir} ({self.dtype}, {self.device})")
        self.model, hf_config = load_model(model_dir, self.dtype, self.device)
        say(f"weights loaded in {time.monotonic() - start:.1f} s")

        self.eos_token_ids = Tokenizer(model_dir).eos_token_ids
        self.vocab_size = int(hf_config.vocab_size)
        max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(
                    f"--max-model-len {config.max_model_len} exceeds the model's "
                    f"max_position_embeddings ({max_len})"
                )
            max_len = config.max_model_len

        window = getattr(self.model, "sliding_window", None)
        if window and max_len > window:
            # Sliding-window attention is not implemented: beyond the window the
            # outputs would differ from the reference model, so the context stops there.
            say(f"max_model_len capped at the model's sliding window ({window})")
            max_len = window

        block_size = config.block_size
        num_blocks = self._num_kv_blocks(max_len, block_size)
        # A single sequence must always fit, or preemption could never make room.
        max_len = min(max_len, num_blocks * block_size)
        self.max_model_len = max_len
        self.runner = ModelRunner(
            self.model, num_blocks, block_size, self.dtype, self.device, self.eos_token_ids
        )
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            max(config.max_num_batched_tokens, 1),
            config.scheduling_policy,
        )
        self.model_info = ModelInfo(
            model_dir=model_dir,
            max_model_len=max_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            num_kv_blocks=num_blocks,
            block_size=block_size,
        )
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        say(
            f"KV cache: {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), max_model_len {max_len}"
        )

    def _num_kv_blocks(self, max_model_len: int, block_size: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = kv_cache_bytes_per_block(self.model, block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cfg.gpu_memory_utilization) - used - (1 << 30)
        else:
            needed = cfg.max_num_seqs * max_model_len * per_block // block_size
            budget = cfg.kv_cache_memory or min(DEFAULT_CPU_KV_BYTES, needed)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(
                "no room for the KV cache: raise --kv-cache-memory (CPU) or "
                "--gpu-memory-utilization (GPU)"
            )
        return int(blocks)

    # -- requests --------------------------------------------------------------------
    def add_request(self, msg: AddRequest, client_id: bytes = b"") -> Admission:
        rid = msg.request_id
        problem = self._validate(msg)
        if problem is not None:
            return Admission(request_id=rid, accepted=False, error_kind="invalid", message=problem)
        cfg, sched = self.config, self.scheduler
        if cfg.max_num_queued_reqs is not None and sched.num_waiting >= cfg.max_num_queued_reqs:
            return Admission(
                request_id=rid,
                accepted=False,
                error_kind="overloaded",
                message=f"The server is at capacity ({sched.num_waiting} requests waiting); retry later.",
            )
        if (
            cfg.max_num_queued_tokens is not None
            and sched.num_waiting_tokens + len(msg.prompt_token_ids) > cfg.max_num_queued_tokens
        ):
            return Admission(
                request_id=rid,
                accepted=False,
                error_kind="overloaded",
                message=f"The server is at capacity ({sched.num_waiting_tokens} prompt tokens waiting); retry later.",
            )
        request = Request(
            rid,
            msg.prompt_token_ids,
            msg.params,
            client_id,
            msg.priority,
            msg.arrival_time or None,
        )
        sched.add(request)
        self.num_prompt_tokens_total += request.num_prompt_tokens
        return Admission(request_id=rid, accepted=True)

    def _validate(self, msg: AddRequest) -> str | None:
        ids = msg.prompt_token_ids
        if msg.request_id in self.scheduler.requests:
            return f"request id {msg.request_id!r} is already in use"
        if not ids:
            return "the prompt is empty"
        if len(ids) >= self.max_model_len:
            return (
                f"The prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, including at least one generated token."
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            return f"prompt token ids must be in [0, {self.vocab_size})"
        p = msg.params
        if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= self.vocab_size:
            return f"prompt_logprobs must be in [0, {self.vocab_size}]"
        if p.max_tokens < 0:
            return "max_tokens must be at least 0 (0: prefill and score the prompt only)"
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.scheduler.abort(rid)
            if request is not None:
                self.runner.forget(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step ----------------------------------------------------------------------
    def step(self) -> list[tuple[bytes, RequestOutput]]:
        """Run one step; returns each new output with the client it goes to."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        result = self.runner.execute(sched_out.scheduled)
        self.scheduler.commit_step(sched_out)
        for scored_request, entries in result.prompt_logprobs:
            assert scored_request.prompt_logprobs is not None
            scored_request.prompt_logprobs.extend(entries)
        if result.output is None:
            return []
        outputs: list[tuple[bytes, RequestOutput]] = []
        logprobs = result.output.logprobs
        for row, item in enumerate(result.sampled):
            request = item.request
            if request.params.max_tokens == 0:
                outputs.append((request.client_id, self._finish_scoring(request)))
                continue
            first_output = request.num_output_tokens == 0
            token = result.output.token_ids[row]
            request.all_token_ids.append(token)
            self.num_generation_tokens_total += 1
            finish = self._check_stop(request, token)
            out = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[token],
                new_logprobs=[logprobs[row]] if logprobs is not None and logprobs[row] else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                prompt_logprobs=request.prompt_logprobs if first_output else None,
            )
            if finish is not None:
                out.finish_reason = finish
                out.stop_reason = request.stop_reason
                self.scheduler.finish(request, finish)
                self.runner.forget(request)
            outputs.append((request.client_id, out))
        return outputs

    def _finish_scoring(self, request: Request) -> RequestOutput:
        """A `max_tokens` 0 request ends once its prompt is prefilled (and scored, when
        it asked for prompt logprobs): the token sampled from its last row is dropped."""
        self.scheduler.finish(request, "length")
        self.runner.forget(request)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            prompt_logprobs=request.prompt_logprobs,
            finish_reason="length",
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _check_stop(self, request: Request, token: int) -> str | None:
        p: SamplingParams = request.params
        num_out = request.num_output_tokens
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                request.stop_reason = token
                return "stop"
        if num_out >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- start-up -----------------------------------------------------------------------
    def warm_up(self) -> float:
        """One prefill and a few decodes through the real step path, so the first
        client request doesn't pay for lazy initialisation (allocator, oneDNN/cuBLAS)."""
        start = time.monotonic()
        n = min(self.config.max_num_batched_tokens, self.max_model_len - 8, 64)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        msg = AddRequest(request_id="__warmup__", prompt_token_ids=[1] * max(n, 1), params=params)
        admission = self.add_request(msg)
        if not admission.accepted:
            raise RuntimeError(f"warm-up request refused: {admission.message}")
        while self.has_work():
            self.step()
        self.block_manager.reset_prefix_cache()
        self.num_prompt_tokens_total = self.num_generation_tokens_total = 0
        return time.monotonic() - start
