"""The engine core: admission, scheduling, one forward per step, token-level stops.

`EngineCore` is transport-free: `add_request`, `abort` and `step` are plain calls. The
busy loop in `engine/core_loop.py` drives it from ZeroMQ (own process) or from a
thread (in-process mode).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable

import msgspec
import torch

from engine.attention import CpuAttentionBackend, PagedAttentionBackend
from engine.backends import (
    choose_backends,
    defer_gguf_linears,
    linear_storage_dtype,
    read_deferred_weights,
)
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelInfo, default_prefill_chunk
from engine.gpu_memory import (
    GRAPH_AND_FRAGMENTATION_RESERVE,
    kv_cache_budget_bytes,
    profile_peak_step_bytes,
)
from engine.host_memory import (
    available_bytes,
    cpu_kv_budget_bytes,
    keep_freed_heap_for_reuse,
    return_freed_heap,
)
from engine.layers.weight_storage import widen_dense_weights
from engine.lora.manager import AdapterError, AdapterNotFoundError, LoRAManager, NoFreeSlotError
from engine.lora_source import (
    AdapterSourceError,
    default_fetch_root,
    discard_fetched,
    listed_source,
    resolve_adapter_source,
)
from engine.messages import (
    AdapterCard,
    AdapterCommand,
    AdapterReply,
    AddRequest,
    Admission,
    ControlCommand,
    ControlReply,
    PoolingParams,
    RequestOutput,
    SessionCommand,
    SessionReply,
)
from engine.model_loader import load_model
from engine.model_runner import ModelRunner, StepResult, kv_cache_bytes_per_block
from engine.pooling_config import read_pooling_config
from engine.profiler import ProfilerError, StepProfiler
from engine.request import Request
from engine.resolved_config import resolve
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.sessions import SessionTable, SessionTableFull
from engine.structured.grammar import GrammarState
from engine.structured.manager import StructuredOutputManager
from engine.tokenizer import Tokenizer
from kernels import select_backend

logger = logging.getLogger("hearth.engine")


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (the model's modules and parameters, the
    tokenizer, compiled programs: hundreds of thousands of objects) out of the cyclic
    collector's reach. Each step allocates enough short-lived objects to trigger collections,
    and those traversed the start-up objects every time: 2 % of a batch-64 decode step's
    CPU in `gc_collect_main` (perf, AMX host, 2026-12-02). Refcounting still frees them;
    only cycles among them would stay, and start-up builds none worth collecting. Called by
    the engine process once it is ready (a process of its own, so nothing else is frozen),
    not by `warm_up`: a test process that builds many cores would keep their cycles."""
    gc.collect()
    gc.freeze()


DEFAULT_CPU_KV_BYTES = 4 << 30
"""vLLM-CPU's default KV space; memory is committed only as blocks are used."""
MAX_CONSECUTIVE_STEP_FAILURES = 3
"""A step that raises fails only its own requests; this many in a row means the engine
itself is broken, and it exits so the platform restarts the container."""


SESSION_GONE = "The session is unknown, closed or expired; start a new one (NEW_SESSION)."


class InjectedFault(RuntimeError):
    """Raised by the test-only fault hook."""


class EngineCore:
    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda msg: logger.info("%s", msg))
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        resolved = resolve(config, say)
        self.device, self.dtype = resolved.device, resolved.dtype
        select_backend(config.kernels)
        if config.seed is not None:
            torch.manual_seed(config.seed)

        model_dir = resolved.model_dir
        start = time.monotonic()
        say(f"loading {model_dir} ({self.dtype}, {self.device})")
        held = linear_storage_dtype(config, model_dir, self.dtype, self.device)
        defer = defer_gguf_linears(config, model_dir, self.dtype, self.device)
        self.model, hf_config = load_model(model_dir, self.dtype, self.device, say, held, defer)
        self.backends = choose_backends(self.model, config, model_dir, self.dtype, self.device, say)
        read_deferred_weights(self.model, say)
        # What runs dense gets the model dtype back; a held embedding table stays in 16 bits
        # where the C gather reads it (every mode but the exact one).
        widen_dense_weights(self.model, self.dtype, tables=self.backends.quantization == "none")
        return_freed_heap()  # before the KV cache's budget reads what is left
        keep_freed_heap_for_reuse()  # from now on a step's freed tensors serve the next
        say(f"weights loaded in {time.monotonic() - start:.1f} s")

        self.eos_token_ids = Tokenizer(model_dir).eos_token_ids
        self.vocab_size = int(hf_config.vocab_size)
        self.pooling = msgspec.structs.replace(
            read_pooling_config(model_dir), hidden_size=int(hf_config.hidden_size)
        )
        say(f"embeddings: {self.pooling.unsupported or self.pooling.source}")
        max_len = resolved.max_model_len
        self.max_num_batched_tokens = resolved.max_num_batched_tokens
        self.max_prefill_chunk = resolved.max_prefill_chunk or default_prefill_chunk(
            self.device.type, self.max_num_batched_tokens, self.backends.tiled_linears
        )
        say(
            f"scheduler: {self.max_num_batched_tokens} tokens a step, a first prompt chunk "
            f"of up to {self.max_prefill_chunk}"
        )
        block_size = config.block_size
        # Before the KV cache is sized: on a GPU the stacked adapter slots take memory too.
        self.lora = self._start_lora(say)
        num_blocks = self._num_kv_blocks(max_len, block_size, say)
        # A single sequence must always fit, or preemption could never make room.
        max_len = min(max_len, num_blocks * block_size)
        self.max_model_len = max_len
        attention = self.backends.attention
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            block_size,
            self.backends.kv_dtype,
            self.device,
            self.eos_token_ids,
            attention,
            self.pooling,
            self.backends.v_dtype,
        )
        if (
            isinstance(attention, CpuAttentionBackend)
            and not config.enforce_eager
            and attention.capture_program(self.model, block_size) is not None
        ):
            say(f"CPU step program: {attention.num_program_ops} kernel calls per step, one C call")
        if isinstance(attention, PagedAttentionBackend):
            self.runner.cuda_graphs = attention.capture_graphs(
                self.model, block_size, max_len, config.max_num_seqs, self.device,
                config.enforce_eager, say,
            )  # fmt: skip
        self.runner.lora = self.lora
        self.block_manager = BlockManager(
            num_blocks, block_size, config.enable_prefix_caching, self.model.sliding_window
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.scheduling_policy,
            max_prefill_chunk=self.max_prefill_chunk,
        )
        self.sessions = SessionTable(self.block_manager)
        self.profiler = (
            StepProfiler(config.profiler, self.device.type == "cuda")
            if config.profiler is not None and config.profiler.profiler is not None
            else None
        )
        self.model_info = ModelInfo(
            model_dir=model_dir,
            max_model_len=max_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            quantization=self.backends.quantization,
            kernels=self.backends.description,
            pooling=self.pooling,
            architecture=type(self.model).__name__,
            max_num_seqs=config.max_num_seqs,
            engine_config=msgspec.to_builtins(config)
            | {
                "max_model_len": max_len,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_prefill_chunk": self.max_prefill_chunk,
            },
        )
        self.structured = StructuredOutputManager(model_dir, self.vocab_size, self.eos_token_ids)
        self.num_prompt_tokens_total = 0
        """Prompt tokens of every request admitted."""
        self.num_prefill_tokens_computed = 0
        """Prompt tokens run through the model (chunk by chunk, prefix-cache hits not
        counted): what the periodic log's prompt throughput is."""
        self.num_generation_tokens_total = 0
        self.num_consecutive_step_failures = 0
        self._fault_file = config.test_fault_file
        self._step_delay = config.test_step_delay
        say(
            f"KV cache: {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), max_model_len {max_len}"
        )

    def _start_lora(self, say: Callable[[str], None]) -> LoRAManager | None:
        """--enable-lora: stacked slots on every projection, then the start-up adapters
        (a bad one fails the start, naming it)."""
        cfg = self.config
        if not cfg.enable_lora:
            return None
        manager = LoRAManager(self.model, cfg.max_loras, cfg.max_lora_rank, self.dtype, self.device)
        fetch_root = default_fetch_root()
        for name, src in cfg.lora_modules:
            try:
                path = resolve_adapter_source(src, fetch_root)
                try:
                    manager.register(name, path, source=listed_source(src))
                finally:  # the weights are in memory now (or refused): drop a download
                    discard_fetched(path, fetch_root)
            except (AdapterError, AdapterSourceError, ValueError) as exc:
                raise ValueError(f"--lora-modules {name}={src}: {exc}") from None
        say(
            f"LoRA: {len(manager.adapters)} adapters registered, {cfg.max_loras} resident "
            f"at most (--max-loras), rank up to {cfg.max_lora_rank}"
        )
        return manager

    def _num_kv_blocks(
        self, max_model_len: int, block_size: int, say: Callable[[str], None]
    ) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = kv_cache_bytes_per_block(
            self.model, block_size, self.backends.kv_dtype, self.backends.v_dtype
        )
        if self.device.type == "cuda":
            peak = profile_peak_step_bytes(
                self.model,
                self.max_prefill_chunk,  # the longest step: >= the budget
                cfg.max_num_seqs,
                block_size,
                self.dtype,
                self.device,
            )
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_cache_budget_bytes(
                total, free, peak, cfg.gpu_memory_utilization, GRAPH_AND_FRAGMENTATION_RESERVE
            )
        elif cfg.kv_cache_memory:
            budget = cfg.kv_cache_memory
            available = available_bytes()
            if available is not None and budget > available:
                say(
                    f"--kv-cache-memory {budget / 2**30:.1f} GiB is more than the "
                    f"{available / 2**30:.1f} GiB this host (or container) has left: a full "
                    "cache will not fit"
                )
        else:
            needed = cfg.max_num_seqs * max_model_len * per_block // block_size
            available = available_bytes()
            budget, capped = cpu_kv_budget_bytes(needed, available, DEFAULT_CPU_KV_BYTES)
            if capped and available is not None:
                say(
                    f"KV cache capped at {budget / 2**30:.2f} GiB: the host (or container) has "
                    f"{available / 2**30:.2f} GiB left after the weights, less a reserve "
                    f"(--kv-cache-memory sets it)"
                )
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(
                "no room for the KV cache: free memory on the host or raise "
                "--kv-cache-memory (CPU), or raise --gpu-memory-utilization (GPU)"
            )
        return int(blocks)

    # -- requests --------------------------------------------------------------------
    def add_request(self, msg: AddRequest, client_id: bytes = b"") -> Admission | None:
        """Admit or refuse at once, or (a constrained request whose grammar must first
        compile) return None: `poll_compiled` answers it later."""
        rid = msg.request_id
        problem = self._validate(msg)
        if problem is not None:
            return Admission(request_id=rid, accepted=False, error_kind="invalid", message=problem)
        if msg.lora_name is not None and (
            self.lora is None or msg.lora_name not in self.lora.adapters
        ):
            return Admission(
                request_id=rid,
                accepted=False,
                error_kind="not_found",
                message=f"The model `{msg.lora_name}` does not exist.",
            )
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
        if msg.params.structured is not None:
            self.structured.submit(rid, msg.params.structured, (msg, client_id))
            return None
        return self._admit(msg, client_id, None)

    def _admit(self, msg: AddRequest, client_id: bytes, grammar: GrammarState | None) -> Admission:
        lora = self._pin_adapter(msg)
        if isinstance(lora, Admission):
            return lora
        request = Request(
            msg.request_id,
            msg.prompt_token_ids,
            msg.params,
            client_id,
            msg.priority,
            msg.arrival_time or None,
            pooling=msg.pooling,
            # A pooled prompt is checked against its session (`_validate`) but pins nothing:
            # it leaves no conversation whose next turn would find its blocks warm.
            session_id=msg.session_id if msg.pooling is None else None,
            group=msg.group,
        )
        request.grammar = grammar
        request.pooling_uses_cache = msg.pooling is not None and self.pooling.method == "last"
        if msg.cache_salt:
            request.cache_salt = msg.cache_salt.encode()
        if lora is not None:
            request.lora_name = msg.lora_name
            request.lora_slot, request.lora_key = lora
        self.scheduler.add(request)
        self.num_prompt_tokens_total += request.num_prompt_tokens
        return Admission(request_id=msg.request_id, accepted=True)

    def _pin_adapter(self, msg: AddRequest) -> tuple[int, bytes] | Admission | None:
        """The request's adapter made resident and pinned: (slot, cache key); None for
        the base; a refusal when it is gone (unloaded meanwhile) or no slot is free."""
        if msg.lora_name is None:
            return None
        assert self.lora is not None  # add_request refused lora_name without --enable-lora
        try:
            return self.lora.acquire(msg.lora_name)
        except AdapterNotFoundError:
            message, kind = f"The model `{msg.lora_name}` does not exist.", "not_found"
        except NoFreeSlotError as exc:
            message, kind = str(exc), "overloaded"
        return Admission(
            request_id=msg.request_id, accepted=False, error_kind=kind, message=message
        )

    def adapter_command(self, cmd: AdapterCommand) -> AdapterReply:
        """Register / unregister / list LoRA adapters between steps."""
        if self.lora is None:
            return AdapterReply(
                call_id=cmd.call_id,
                ok=False,
                error_kind="disabled",
                message="LoRA adapters are not enabled on this server (start it with --enable-lora).",
            )
        manager = self.lora
        kind: str | None = None
        message: str | None = None
        try:
            if cmd.op == "load":
                if not cmd.name or not cmd.path:
                    raise AdapterError("a load needs the adapter's name and path")
                manager.register(cmd.name, cmd.path, source=cmd.source)
            elif cmd.op == "unload":
                manager.unregister(cmd.name or "")
            elif cmd.op != "list":
                raise AdapterError(f"unknown adapter command {cmd.op!r}")
        except AdapterNotFoundError:
            kind, message = "not_found", f"The lora adapter '{cmd.name}' cannot be found."
        except AdapterError as exc:
            kind, message = "invalid", str(exc)
        except ValueError as exc:  # the name is registered already
            kind, message = "conflict", str(exc)
        except Exception as exc:  # unreadable files and the like: the adapter's fault
            logger.exception("LoRA adapter command %s %s failed", cmd.op, cmd.name)
            kind, message = "invalid", f"cannot load the adapter ({type(exc).__name__}: {exc})"
        cards = [
            AdapterCard(name=s.name, path=s.path, rank=s.rank, resident=s.resident)
            for s in manager.status()
        ]
        return AdapterReply(
            call_id=cmd.call_id, ok=kind is None, error_kind=kind, message=message, adapters=cards
        )

    def poll_compiled(self) -> list[tuple[bytes, Admission]]:
        """Admit (or refuse) the constrained requests whose grammar finished compiling."""
        answers: list[tuple[bytes, Admission]] = []
        for result in self.structured.ready():
            msg, client_id = result.payload
            if result.compiled is None:
                spec = msg.params.structured
                param = spec.param if spec is not None and spec.param else None
                prefix = f"{param}: " if param else ""
                admission = Admission(
                    request_id=msg.request_id,
                    accepted=False,
                    error_kind="invalid",
                    message=f"{prefix}{result.error}",
                    param=param,
                )
            elif msg.request_id in self.scheduler.requests:
                admission = Admission(
                    request_id=msg.request_id,
                    accepted=False,
                    error_kind="invalid",
                    message=f"request id {msg.request_id!r} is already in use",
                )
            else:
                admission = self._admit(msg, client_id, GrammarState(result.compiled))
            answers.append((client_id, admission))
        return answers

    @property
    def num_compiling(self) -> int:
        return self.structured.num_pending

    def _validate(self, msg: AddRequest) -> str | None:
        ids = msg.prompt_token_ids
        if msg.request_id in self.scheduler.requests or self.structured.is_pending(msg.request_id):
            return f"request id {msg.request_id!r} is already in use"
        if not ids:
            return "the prompt is empty"
        if msg.session_id is not None and not self.sessions.is_live(msg.session_id):
            return SESSION_GONE
        if msg.pooling is not None:
            return self._validate_embedding(msg)
        if self.pooling.classifier is not None:
            return (
                "this model is a sequence classifier: it generates no text (it serves "
                "/classify, /score and /rerank)"
            )
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
        if p.logprob_token_ids and (
            min(p.logprob_token_ids) < 0 or max(p.logprob_token_ids) >= self.vocab_size
        ):
            return f"logprob_token_ids must be in [0, {self.vocab_size})"
        if p.bad_words_token_ids and any(
            not ids or min(ids) < 0 or max(ids) >= self.vocab_size for ids in p.bad_words_token_ids
        ):
            return f"bad_words token ids must be in [0, {self.vocab_size})"
        return None

    def _validate_embedding(self, msg: AddRequest) -> str | None:
        """An embedding request generates nothing, so its prompt may fill the context."""
        ids = msg.prompt_token_ids
        if self.pooling.unsupported is not None and self.pooling.classifier is None:
            return self.pooling.unsupported
        if len(ids) > self.max_model_len:
            return (
                f"The input has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens."
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            return f"input token ids must be in [0, {self.vocab_size})"
        assert msg.pooling is not None
        return self.pooling.check_dimensions(msg.pooling.dimensions)

    # -- stateful sessions --------------------------------------------------------------
    def session_command(self, cmd: SessionCommand) -> SessionReply:
        """Open or close a session (engine/sessions.py): the table every worker shares."""
        if cmd.op == "open":
            try:
                session_id, expires_at = self.sessions.open(cmd.ttl_s)
            except SessionTableFull as exc:
                return SessionReply(
                    call_id=cmd.call_id, ok=False, error_kind="overloaded", message=str(exc)
                )
            return SessionReply(
                call_id=cmd.call_id, ok=True, session_id=session_id, expires_at=expires_at
            )
        if cmd.op == "close" and cmd.session_id is not None:
            if self.sessions.is_live(cmd.session_id) and self.sessions.close(cmd.session_id):
                return SessionReply(call_id=cmd.call_id, ok=True, session_id=cmd.session_id)
            return SessionReply(
                call_id=cmd.call_id, ok=False, error_kind="invalid", message=SESSION_GONE
            )
        return SessionReply(
            call_id=cmd.call_id,
            ok=False,
            error_kind="invalid",
            message=f"unknown session operation {cmd.op!r}",
        )

    # -- operator commands (vLLM's dev and profiler routes) ------------------------------
    def control_command(self, cmd: ControlCommand) -> ControlReply:
        """Reset the prefix cache, or start / stop the step profiler, between steps."""
        try:
            if cmd.op == "reset_prefix_cache":
                ok = self.reset_prefix_cache(cmd.reset_running_requests)
                return ControlReply(call_id=cmd.call_id, ok=ok)
            if cmd.op in ("start_profile", "stop_profile"):
                if self.profiler is None:
                    raise ProfilerError(
                        "No profiler: start the server with --profiler-config "
                        '\'{"profiler": "torch", "torch_profiler_dir": "/abs/dir"}\''
                    )
                if cmd.op == "stop_profile":
                    files = self.profiler.stop()
                    logger.info("profiler stopped; wrote %s", ", ".join(files) or "nothing")
                    return ControlReply(call_id=cmd.call_id, ok=True, files=files)
                self.profiler.start(cmd.profile_prefix, cmd.delay_iterations, cmd.max_iterations)
                logger.info("profiler started")
                return ControlReply(call_id=cmd.call_id, ok=True)
        except ProfilerError as exc:
            return ControlReply(
                call_id=cmd.call_id, ok=False, error_kind="invalid", message=str(exc)
            )
        return ControlReply(
            call_id=cmd.call_id,
            ok=False,
            error_kind="invalid",
            message=f"unknown control operation {cmd.op!r}",
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (vLLM's semantics): refused (False) while running
        requests hold blocks, unless `reset_running_requests`, which preempts them first
        (they recompute from their tokens so far, as after any preemption)."""
        sched = self.scheduler
        if reset_running_requests:
            for request in list(reversed(sched.running)):  # back first: FIFO order kept
                sched.preempt(request)
        if self.block_manager.num_used_blocks:
            return False
        self.block_manager.reset_prefix_cache()
        logger.info("prefix cache reset")
        return True

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.structured.discard(rid):
                continue
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self._finish(request, "abort")

    def _finish(self, request: Request, reason: str) -> None:
        """The one way a request ends: its blocks and queue place (scheduler) and its
        per-request sampler state (runner) go together."""
        self.scheduler.finish(request, reason)
        self.runner.forget(request)
        if request.lora_slot >= 0:
            assert self.lora is not None
            self.lora.release(request.lora_slot)
            request.lora_slot = -1

    def abort_client(self, client_id: bytes) -> int:
        """Abort every request of one worker (it died), those whose constraint is still
        compiling included (admitted later, they would run to max_tokens for nobody: the
        worker is reported gone once); returns how many."""
        ids = [rid for rid, r in self.scheduler.requests.items() if r.client_id == client_id]
        ids += [
            rid
            for rid, (_, owner) in self.structured.pending_payloads().items()
            if owner == client_id
        ]
        self.abort(ids)
        if ids:
            logger.warning("worker %r is gone: aborted its %d requests", client_id, len(ids))
        return len(ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step ----------------------------------------------------------------------
    def step(self) -> list[tuple[bytes, RequestOutput]]:
        """Run one step; returns each new output with the client it goes to.

        If the forward pass or sampling raises (an OOM on a big prefill, a sampler bug),
        only the requests scheduled in this step fail, with finish_reason 'error'; their
        blocks are freed and the engine goes on. Several failures in a row re-raise.
        """
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        try:
            if self._step_delay:
                time.sleep(self._step_delay)
            if self._fault_file is not None and os.path.exists(self._fault_file):
                os.unlink(self._fault_file)
                raise InjectedFault("injected fault (test hook)")
            result = self.runner.execute(sched_out.scheduled)
        except Exception as exc:
            self.num_consecutive_step_failures += 1
            if self.num_consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            logger.exception(
                "engine step failed; failing its %d requests", len(sched_out.scheduled)
            )
            return self._fail_step(sched_out.scheduled, exc)
        self.num_consecutive_step_failures = 0
        if self.profiler is not None and self.profiler.active:
            self.profiler.after_step()
        self.num_prefill_tokens_computed += sum(
            max(
                0,
                min(
                    item.num_new_tokens,
                    item.request.num_prompt_tokens - item.request.num_computed_tokens,
                ),
            )
            for item in sched_out.scheduled
        )
        return self._postprocess(sched_out, result)

    def _postprocess(
        self, sched_out: SchedulerOutput, result: StepResult
    ) -> list[tuple[bytes, RequestOutput]]:
        """Every after-step update, in one place (nano-vllm's ``postprocess``): advance the
        scheduled sequences, attach scored prompt tokens, append each sampled token, apply
        token-level stops and grammars, and finish what ended."""
        self.scheduler.commit_step(sched_out)
        for scored_request, entries in result.prompt_logprobs:
            assert scored_request.prompt_logprobs is not None
            scored_request.prompt_logprobs.extend(entries)
        outputs = [
            (request.client_id, self._finish_embedding(request, vector))
            for request, vector in result.embeddings
        ]
        if result.output is None:
            return outputs
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
            on_stop_token = finish == "stop"
            error = None
            if request.grammar is not None and finish is None:
                try:
                    finish = self._advance_grammar(request, token)
                except Exception as exc:  # the grammar library's fault ends this request only
                    logger.exception("request %s: its grammar failed", request.request_id)
                    finish = "error"
                    error = f"The engine failed while running this request ({type(exc).__name__})."
            out = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[token],
                new_logprobs=[logprobs[row]] if logprobs is not None and logprobs[row] else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                prompt_logprobs=request.prompt_logprobs if first_output else None,
                error=error,
            )
            if finish is not None:
                out.finish_reason = finish
                out.stop_reason = request.stop_reason
                out.finished_on_stop_token = on_stop_token
                self._finish(request, finish)
            outputs.append((request.client_id, out))
        return outputs

    def _fail_step(
        self, scheduled: list[ScheduledRequest], exc: Exception
    ) -> list[tuple[bytes, RequestOutput]]:
        outputs: list[tuple[bytes, RequestOutput]] = []
        for item in scheduled:
            request = item.request
            if request.is_finished:
                continue
            self._finish(request, "error")
            out = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason="error",
                num_prompt_tokens=request.num_prompt_tokens,
                # The client sees the kind of failure, never internals or a traceback.
                error=f"The engine failed while running this request ({type(exc).__name__}).",
            )
            outputs.append((request.client_id, out))
        return outputs

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> str | None:
        """Feed the sampled token to the request's grammar. A grammar that accepted its
        stop token has nothing left to match, so the request ends there even under
        min_tokens or ignore_eos (the mask would allow no further token)."""
        grammar = request.grammar
        assert grammar is not None
        if not grammar.accept(token):
            logger.error(
                "request %s: sampled token %d rejected by its grammar", request.request_id, token
            )
            return "stop"
        return "stop" if grammar.is_terminated else None

    def _finish_scoring(self, request: Request) -> RequestOutput:
        """A `max_tokens` 0 request ends once its prompt is prefilled (and scored, when
        it asked for prompt logprobs): the token sampled from its last row is dropped."""
        self._finish(request, "length")
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            prompt_logprobs=request.prompt_logprobs,
            finish_reason="length",
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _finish_embedding(self, request: Request, vector: bytes) -> RequestOutput:
        """An embedding request ends with its prompt's last chunk: one output carries the
        vector, and its blocks are freed now (they were never put in the prefix cache)."""
        self._finish(request, "stop")
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            embedding=vector,
            finish_reason="stop",
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def _check_stop(self, request: Request, token: int) -> str | None:
        p: SamplingParams = request.params
        num_out = request.num_output_tokens
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in request.stop_token_set:
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
        n = min(self.max_num_batched_tokens, self.max_model_len - 8, 64)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        msg = AddRequest(request_id="__warmup__", prompt_token_ids=[1] * max(n, 1), params=params)
        if self.pooling.classifier is not None:  # it generates nothing: one prompt pooled
            msg = AddRequest(
                request_id="__warmup__",
                prompt_token_ids=[1] * max(n, 1),
                params=SamplingParams(max_tokens=0),
                pooling=PoolingParams(),
            )
        admission = self.add_request(msg)
        if admission is None or not admission.accepted:
            raise RuntimeError(f"warm-up request refused: {admission.message}")
        while self.has_work():
            self.step()
        self.block_manager.reset_prefix_cache()
        self.num_prompt_tokens_total = self.num_generation_tokens_total = 0
        self.num_prefill_tokens_computed = 0
        return time.monotonic() - start
