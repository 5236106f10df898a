"""Which kernels compute: chosen once at start-up, from --quantization, --dtype and the host.

- ``none`` (the exact mode): every `Linear` keeps its dense method, the elementwise ops
  and attention run the torch reference (Triton on CUDA); op for op what transformers
  computes, so float32 greedy output is token-identical to transformers. MoE experts run
  through their expert linears, or as one Triton grouped GEMM where the kernels are
  Triton (`GroupedGemmMoEMethod`, engine/layers/moe.py).
- ``gguf`` (the CPU fast path): each linear whose GGUF blocks have a kernel gets
  `GGUFBlockLinearMethod` (the file's Q4_1/Q8_0 blocks, float32 activations and
  accumulation: the weights are exactly the file's and only the order of float32 sums
  differs from the dequantized model), the elementwise ops run the C kernels and
  attention the C backend (float32 KV cache; float16 with ``--kv-cache-dtype float16``). No result depends on batch size,
  chunking or thread count (docs/performance.md has the measured quality figures).
- ``gguf-bf16`` (the default for a GGUF on a CPU with AMX-BF16 or AVX512-BF16): the same
  blocks for calls under `bf16_ops.default_min_t()` tokens (16 where AMX runs the tiles, 6
  on AVX512-BF16), and for calls from there up (prefill, batched decode) the
  dequantized weights rounded once to bfloat16 in AMX tiles, bfloat16 activations and
  float32 sums (`GGUFTiledLinearMethod`, ``kernels/cpu/hearth_bf16.c``; from 32 tokens up on
  AMX the same tiles are built on the fly from the blocks, bit for bit); prefill runs of
  16+ tokens of a sequence attend on the same units (bfloat16 Q, K, V and softmax weights,
  float32 sums: ``kernels/cpu/hearth_attention_bf16.c``), decodes in float32. Within each side
  of the threshold a token's result does not depend on the batch; across it, it may (a
  request decoding alone and inside a batch of 16 can differ in the last bits; a prompt the
  step budget cuts into a piece under 16 tokens attends that piece in float32), so
  ``gguf`` is the mode to ask for when batch invariance matters.
- ``gguf-int8``: the same with int8-quantized activations (`GGUFInt8LinearMethod`: AMX
  tiles, AVX512-VNNI or AVX2, the same bits on each). Faster, but it misses the quality
  bar on SmolLM2 (top-1 agreement 97 %), so it is never the default.
- A model that ships no GGUF (safetensors alone) runs ``gguf`` and ``gguf-bf16`` from its
  own weights in 16 bits (`HalfWeights`, engine/layers/half_weights.py): bfloat16 where a
  weight's values all are (a bf16 checkpoint: exactly its weights), float16 where they all
  are, else rounded once to float16 (a float32 checkpoint: SmolLM2 KL 3e-6, top-1 99.86 %,
  within the quality bar by a wide margin). ``q8_0`` (and ``gguf-int8``, whose integer
  kernels read blocks only) quantize its linears to Q8_0 at load instead (`QuantizedWeights`,
  engine/layers/q8_0_weights.py), the blocks llama.cpp would write for it: faster at one
  stream, but below the quality bar (SmolLM2 top-1 98.1 %), so never the default.
- ``auto``: ``gguf-bf16`` for a GGUF or safetensors model on a CPU with AMX-BF16 or
  AVX512-BF16 (``gguf`` on other CPUs with AVX2, or with ``--cpu-isa`` below them) when
  ``--dtype`` is left at auto, else ``none``. Asking for ``--dtype float32`` is asking for the exact mode.
  What ``auto`` picks runs with float16 keys and int8 values (`DEFAULT_FAST_KV`), as both
  GGUF modes pass the quality bar with them; a GGUF mode asked for by name keeps its own
  KV default (float32 for ``gguf``, the mode that matches the dequantized model).

The model file learns none of this: `choose_backends` hands methods to its layers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionBackend, CpuAttentionBackend, PagedAttentionBackend
from engine.config import QUANTIZATIONS, EngineConfig
from engine.layers.attention import has_sinks
from engine.layers.gguf_linear import (
    BlockSource,
    GGUFBlockLinearMethod,
    GGUFInt8LinearMethod,
    GGUFSource,
    GGUFTiledLinearMethod,
    gather_table_from_blocks,
)
from engine.layers.half_weights import HalfWeights
from engine.layers.kernel_ops import use_kernel_ops
from engine.layers.linear import Linear, non_linear_parameter_ids
from engine.layers.moe import GROUPED_GEMM, PACKED_EXPERTS, FusedMoE, use_moe_method
from engine.layers.q8_0_weights import QuantizedWeights
from engine.model_loader import checkpoint_dtype
from engine.model_resolver import gguf_source
from kernels.cpu import bf16_ops, ops, q8_ops
from kernels.cpu.build import host_isa, select_variant, set_cache_dir
from kernels.registry import backend_for_device, select_backend

logger = logging.getLogger("hearth.engine")

TILES_BY_DEFAULT = True
"""Whether ``auto`` picks ``gguf-bf16`` where a bfloat16 kernel runs (AMX-BF16 tiles, or
AVX512-BF16 dot products on Zen 4): it passes the quality bar on both (docs/performance.md,
"Precision modes"), and the batch-invariant ``gguf`` costs more than 10 % at 16 and 64
concurrent requests there (~2x), so invariance is the named flag, not the default."""


def auto_gguf_mode() -> str:
    """The GGUF mode ``--quantization auto`` runs on this host (after ``--cpu-isa``)."""
    return "gguf-bf16" if TILES_BY_DEFAULT and bf16_ops.available(host_isa().variant) else "gguf"


@dataclass(frozen=True, slots=True)
class Backends:
    quantization: str
    """``gguf``, ``gguf-bf16``, ``gguf-int8`` or ``none``: what runs."""
    description: str
    """One line for the start-up log and /version."""
    attention: AttentionBackend
    kv_dtype: torch.dtype
    """Element type of the KV cache the runner allocates (of its keys, where ``v_dtype`` is
    set)."""
    v_dtype: torch.dtype | None = None
    """Element type of the values where it differs from the keys' (float16 keys, int8
    values: ``--kv-cache-dtype float16-int8``)."""
    tiled_linears: bool = False
    """Whether the linears of 16+ token calls run on AMX tiles, whose cost per token keeps
    falling with the rows of a call: the scheduler's default first prompt chunk is longer
    there (engine/config.py, `default_prefill_chunk`)."""


def _exact(dtype: torch.dtype, device: torch.device, kernels: str) -> Backends:
    select_backend(kernels)  # validated again: the engine selected it before loading
    name = backend_for_device(device)  # triton on CUDA under --kernels auto
    weights = str(dtype).removeprefix("torch.")
    description = f"dense {weights} weights, {name} kernels ({device.type})"
    return Backends("none", description, PagedAttentionBackend(dtype), dtype)


_HELD_KINDS = {"BF16": torch.bfloat16, "F16": torch.float16}


def linear_storage_dtype(
    config: EngineConfig, model_dir: str, dtype: torch.dtype, device: torch.device
) -> torch.dtype | None:
    """The type to hold linear weights and embedding tables in while loading
    (`load_model`'s `linear_dtype`): a bf16 or f16 checkpoint's own, where its weights are
    to be packed in 16 bits (`HalfWeights`: a model without a GGUF under ``auto``, ``gguf``
    or ``gguf-bf16`` on CPU); None (the model's `dtype`) otherwise. What ends up dense is
    widened back once the backends are chosen (`widen_dense_weights`,
    engine/layers/weight_storage.py)."""
    if not _packs_on_cpu(config, dtype, device, ("auto", "gguf", "gguf-bf16")):
        return None
    if gguf_source(model_dir) is not None:
        return None
    return _HELD_KINDS.get(checkpoint_dtype(model_dir) or "")


def _packs_on_cpu(
    config: EngineConfig, dtype: torch.dtype, device: torch.device, modes: tuple[str, ...]
) -> bool:
    """Whether `config` asks for one of the CPU packing `modes` for a float32 CPU model
    (``auto`` counts only with ``--dtype auto``: a dtype asked for means the exact mode)."""
    asked = config.quantization
    if device.type != "cpu" or dtype != torch.float32 or asked not in modes:
        return False
    return asked != "auto" or config.dtype == "auto"


def defer_gguf_linears(
    config: EngineConfig, model_dir: str, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether to leave linear weights unread while loading (`load_model`'s
    `defer_linears`): a GGUF model on CPU under a GGUF mode, whose blocks will replace
    them. What is not packed after all is read in `choose_backends`."""
    gguf_modes = ("auto", "gguf", "gguf-bf16", "gguf-int8")
    return _packs_on_cpu(config, dtype, device, gguf_modes) and gguf_source(model_dir) is not None


def read_deferred_weights(model: nn.Module, say: Callable[[str], None]) -> None:
    """Read what `defer_gguf_linears` left unread and `choose_backends` did not pack
    (before anything computes with it)."""
    deferred = getattr(model, "deferred_weights", None)
    if deferred is None:
        return
    if filled := deferred.fill_unpacked(model):
        say(f"read {filled} deferred linear weights in full (not packed from the GGUF)")
    del model.deferred_weights


def choose_backends(
    model: nn.Module,
    config: EngineConfig,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    say: Callable[[str], None],
) -> Backends:
    """Resolve ``config.quantization`` for the loaded `model`, give its linear layers their
    methods and select the kernel backend. Raises ValueError when ``gguf`` was asked for
    and cannot run (so the user learns it at start, not from slower answers). Weights
    loaded in 16 bits (`linear_storage_dtype`) that stay dense are widened back after it
    (`widen_dense_weights`, engine/layers/weight_storage.py), and weights left unread
    (`defer_gguf_linears`) that are not packed are read in full (`read_deferred_weights`),
    both by `EngineCore`."""
    set_cache_dir(config.kernel_cache_dir)
    if device.type == "cpu" and host_isa().supported:
        select_variant(config.cpu_isa)  # before any library loads
    asked = config.quantization
    if asked not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {asked!r}: use {', '.join(QUANTIZATIONS)}")
    if asked == "none" or (asked == "auto" and config.dtype != "auto"):
        return _exact_checked(model, config, dtype, device)
    path = gguf_source(model_dir)
    why_not = CpuAttentionBackend.supported(model.head_dim, dtype, device, has_sinks(model))
    if why_not is not None:
        if asked != "auto":
            raise ValueError(f"--quantization {asked} cannot run: {why_not}")
        return _exact_checked(model, config, dtype, device)
    if asked == "q8_0" and path is not None:
        raise ValueError(
            "--quantization q8_0 quantizes a model that ships no GGUF at load; this model "
            "is a GGUF, whose own blocks run under --quantization gguf (or auto)"
        )
    mode = {"auto": auto_gguf_mode(), "q8_0": "gguf"}.get(asked, asked)
    if mode == "gguf-bf16" and not bf16_ops.available(host_isa().variant):
        raise ValueError(
            f"--quantization gguf-bf16 cannot run: it needs AMX-BF16 or AVX512-BF16 "
            f"({bf16_ops.tile_path(host_isa().variant)}; host: {host_isa().describe()}); "
            "use gguf"
        )
    method_cls = {
        "gguf": GGUFBlockLinearMethod,
        "gguf-bf16": GGUFTiledLinearMethod,
        "gguf-int8": GGUFInt8LinearMethod,
    }[mode]
    source = _block_source(path, asked, mode)
    started = time.perf_counter()
    kinds = _use_gguf_blocks(model, method_cls(source))
    if not kinds:
        if asked != "auto":
            raise ValueError(f"--quantization {asked}: no linear fits: {source.describe()}")
        return _exact_checked(model, config, dtype, device)
    use_kernel_ops(model, ops)
    moe = use_packed_experts(model)
    table = ""
    if isinstance(source, GGUFSource):
        gathered = gather_table_from_blocks(model, source)  # before the summary: it counts
        relaid = source.relayout.summary()
        table = (f", re-laid {relaid}" if relaid else "") + (f", {gathered}" if gathered else "")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    packed = [m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    nbytes = sum(p.nbytes for p in packed)
    qtiles = any(getattr(p, "q_min_t", 0) for p in packed)  # only block kinds have Q-tiles
    isa = host_isa()
    min_t = bf16_ops.default_min_t()
    activations = {
        "gguf": "float32 activations",
        "gguf-bf16": f"float32 activations under {min_t} tokens, bfloat16 "
        f"({bf16_ops.tile_path()}) from {min_t} up"
        + (f" (tiles built from the blocks from {bf16_ops.QTILES_MIN_T} up)" if qtiles else ""),
        "gguf-int8": f"int8 activations ({q8_ops.integer_path()})",
    }[mode]
    kv_dtype, v_dtype = _fast_kv_dtypes(config.kv_cache_dtype, mode, by_auto=asked == "auto")
    min_run, attention = 0, ""
    if mode == "gguf-bf16" and (kernel := bf16_ops.attention_path(model.head_dim)) != "none":
        min_run = bf16_ops.ATTENTION_MIN_RUN
        attention = f", prefill attention ({min_run}+ tokens) {kernel}"
    kv = str(kv_dtype).removeprefix("torch.")
    if v_dtype != kv_dtype:
        kv = f"{kv} keys / {str(v_dtype).removeprefix('torch.')} values"
    origin = (
        ""
        if path is not None
        else f", {source.describe()} in {time.perf_counter() - started:.1f} s"
    )
    weights = "16-bit weights" if isinstance(source, HalfWeights) else "GGUF blocks"
    description = (
        f"{weights} ({counts}; {nbytes / 2**20:.0f} MiB{origin}{table}) x {activations}, "
        f"{kv} KV cache{attention}, "
        + (f"{moe} MoE layers' experts in one C call each, " if moe else "")
        + f"C kernels {isa.variant} on {isa.cpu} [{' '.join(isa.flags)}]"
    )
    say(f"fast CPU path: {description}")
    tiled = (mode == "gguf-bf16" and bf16_ops.qtiles_path()) or (
        mode == "gguf-int8" and q8_ops.integer_path() == "amx"
    )
    return Backends(
        asked if asked == "q8_0" else mode, description, CpuAttentionBackend(min_run), kv_dtype,
        v_dtype if v_dtype != kv_dtype else None, tiled,
    )  # fmt: skip


ROUND_BY_DEFAULT = True
"""Whether ``auto`` serves a model without a GGUF from float16-rounded weights where its
checkpoint holds values no 16-bit kind holds exactly (a float32 checkpoint): the rounding
passes the quality bar by a wide margin (docs/performance.md, "A model without a GGUF"), as
vLLM's own CPU default rounds such a model to 16 bits. ``--dtype float32`` keeps it exact."""


def _block_source(path, asked: str, mode: str) -> BlockSource:
    """Where the kernels' weights come from: the GGUF file at `path`; for a model without
    one, its own weights in 16 bits, or, for ``q8_0`` and the int8 kernels (which read
    integer blocks only), the weights quantized to Q8_0 at load."""
    if path is not None:
        return GGUFSource(path)
    if asked == "q8_0" or mode == "gguf-int8":
        return QuantizedWeights()
    return HalfWeights(rounding=asked != "auto" or ROUND_BY_DEFAULT)


DEFAULT_FAST_KV = "float16-int8"
"""``--kv-cache-dtype auto`` under ``gguf-bf16``, and under ``gguf`` where ``--quantization
auto`` chose it: float16 keys, int8 values. The quality bar passes with it in both modes
(docs/performance.md: gguf-bf16 KL 2.54e-4, top-1 99.11 % on the AMX host; gguf KL 5.1e-5,
top-1 99.70 % on an AVX2 host), and decode attention, which reads the whole cache every
step, reads 0.39x float32's bytes (AVX2 host: decode step of 16 sequences at 1024 tokens of
context 91 -> 64 ms). Each row is quantized from its own token's values alone, so the
batch-invariant ``gguf`` stays batch-invariant with it. int8 keys do not pass (top-1
98.36 % per 64-value row, 98.74 % per 32): a key's rounding moves every score it meets, a
value's is averaged by the weights."""


def _fast_kv_dtypes(asked: str, mode: str, by_auto: bool) -> tuple[torch.dtype, torch.dtype]:
    """The fast path's KV cache element types (keys, values). ``auto`` is
    `DEFAULT_FAST_KV` in ``gguf-bf16`` and wherever ``--quantization auto`` (`by_auto`)
    chose the mode; ``gguf`` asked for by name keeps float32: it is the mode that matches
    the dequantized model to ~1e-6 (the scoring tests' reference). ``int8`` (keys too) is
    asked for only: it misses the top-1 bar, for 1.88x float16's tokens in the same
    memory."""
    if asked == "auto":
        asked = DEFAULT_FAST_KV if (mode == "gguf-bf16" or by_auto) else "float32"
    if asked == "float16-int8":
        return torch.float16, torch.int8
    dtype = {"int8": torch.int8, "float16": torch.float16, "float32": torch.float32}[asked]
    return dtype, dtype


def _exact_checked(
    model: nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> Backends:
    """The exact mode, whose KV cache is the model dtype (the torch and Triton kernels
    read nothing else)."""
    asked = config.kv_cache_dtype
    if asked != "auto" and asked != str(dtype).removeprefix("torch."):
        raise ValueError(
            f"--kv-cache-dtype {asked} needs the CPU fast path (--quantization gguf); the "
            f"exact mode keeps the KV cache in the model dtype ({dtype})"
        )
    backends = _exact(dtype, device, config.kernels)
    if backend_for_device(device) == "triton" and (n := use_moe_method(model, GROUPED_GEMM)):
        description = f"{backends.description}, {n} MoE layers by grouped GEMM"
        backends = dataclasses.replace(backends, description=description)
    return backends


def _use_gguf_blocks(model: nn.Module, method: GGUFBlockLinearMethod) -> dict[str, int]:
    """Give every linear the file can feed the GGUF method and free its dense copy (a
    weight shared with the token embedding stays: token lookup reads it). Returns how
    many weights of each block kind were packed."""
    shared = non_linear_parameter_ids(model)
    kinds: dict[str, int] = {}
    deferred = getattr(model, "deferred_weights", None)

    def pack(module: Linear) -> None:
        if deferred is not None and method.reads_dense:
            deferred.fill(module.weight)
        packed = method.pack(module)
        if packed is None:
            return
        module.packed, module.method = packed, method
        kinds[packed.kind] = kinds.get(packed.kind, 0) + 1
        if id(module.weight) not in shared:
            module.weight.data = torch.empty(0)

    done: set[int] = set()
    for module in model.modules():  # a MoE layer comes before its expert linears
        if isinstance(module, FusedMoE):
            experts = [*module.gate_up, *module.down]
            for linear in experts:
                pack(linear)
            done.update(id(linear) for linear in experts)
            _release_packed_experts(module)
        elif isinstance(module, Linear) and id(module) not in done:
            pack(module)
    return kinds


def use_packed_experts(model: nn.Module) -> int:
    """Give `PACKED_EXPERTS` to every SwiGLU `FusedMoE` whose expert linears all run the
    float32-activation blocks (`GGUFBlockLinearMethod` itself: the bf16 tiles and int8
    activations pack otherwise); returns how many took it."""
    count = 0
    for module in model.modules():
        if not isinstance(module, FusedMoE) or module.activation != "silu":
            continue
        linears = [*module.gate_up, *module.down]
        if not all(
            type(m.method) is GGUFBlockLinearMethod and isinstance(m.packed, ops.PackedWeight)
            for m in linears
        ):
            continue
        try:
            experts = ops.PackedExperts.of(
                [m.packed for m in module.gate_up], [m.packed for m in module.down]
            )
        except ValueError:
            continue
        module.packed_experts, module.method = experts, PACKED_EXPERTS
        count += 1
    return count


def _release_packed_experts(module: FusedMoE) -> None:
    """Drop the stacked dense weights of a MoE layer whose every expert linear was packed,
    as soon as they are: its experts then run through those linears' methods, and the stack
    would hold a second, float32 copy of every expert (the bulk of a MoE model). Released
    layer by layer, a method that packs from the dense weight (`gguf-bf16`, which fills each
    deferred expert weight into the stack first) holds one layer's float32 experts at a
    time, not the model's."""
    if all(linear.packed is not None for linear in (*module.gate_up, *module.down)):
        module.w13 = torch.empty(0)
        module.w2 = torch.empty(0)
