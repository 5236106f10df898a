"""Which weights and kernels the engine computes with: the exact mode or the fast path.

- ``none`` (the exact mode): dense weights in ``--dtype`` through the torch kernels, op for
  op as transformers computes; float32 greedy output is token-identical to transformers.
- ``gguf`` (the fast path, CPU): the GGUF file's own Q4_1/Q8_0 blocks through the C
  kernels of ``kernels.cpu``, float32 activations and accumulation. The weights are exactly
  the file's; only the order of float32 sums differs from the dequantized model, and no
  result depends on batch size (docs/performance.md has the measured quality figures).
- ``auto``: ``gguf`` for a GGUF model on a CPU with AVX2 when ``--dtype`` is left at auto,
  else ``none``. Asking for ``--dtype float32`` is asking for the exact mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.gguf_weights import gguf_source, pack_gguf_weights
from engine.models.native_forward import NativeCpuForward
from kernels.cpu.build import host_isa
from kernels.registry import backend_for_device

logger = logging.getLogger("hearth.engine")

MODES = ("auto", "gguf", "none")


@dataclass(frozen=True, slots=True)
class WeightsMode:
    quantization: str
    """``gguf`` or ``none``: what runs."""
    description: str
    """One line for the start-up log and /version."""


def _exact(dtype: torch.dtype, device: torch.device) -> WeightsMode:
    kernels = backend_for_device(device)  # triton on CUDA under --kernels auto
    weights = str(dtype).removeprefix("torch.")
    return WeightsMode("none", f"dense {weights} weights, {kernels} kernels ({device.type})")


def apply_weights_mode(
    model: torch.nn.Module,
    config: EngineConfig,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    say: Callable[[str], None],
) -> WeightsMode:
    """Resolve ``config.quantization`` for the loaded `model` and switch it to the fast
    path when that is the answer. Raises ValueError when ``gguf`` was asked for and
    cannot run (so the user learns it at start, not from slower answers)."""
    asked = config.quantization
    if asked not in MODES:
        raise ValueError(f"unknown --quantization {asked!r}: use auto, gguf or none")
    if asked == "none":
        return _exact(dtype, device)
    source = gguf_source(model_dir)
    why_not = NativeCpuForward.supported(model, dtype, device)
    if source is None:
        why_not = "the model is not a GGUF file"
    if asked == "auto" and config.dtype != "auto":
        return _exact(dtype, device)
    if why_not is not None:
        if asked == "gguf":
            raise ValueError(f"--quantization gguf cannot run: {why_not}")
        return _exact(dtype, device)
    assert source is not None
    packed = pack_gguf_weights(model, source)
    if not packed.kinds:
        if asked == "gguf":
            raise ValueError(f"--quantization gguf: no Q4_1/Q8_0 tensor of {source.name} fits")
        return _exact(dtype, device)
    model.native = NativeCpuForward(model, packed)
    _release_packed_dense(model, packed)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(packed.kinds.items()))
    isa = host_isa()
    description = (
        f"GGUF blocks ({kinds}; {packed.nbytes / 2**20:.0f} MiB) with float32 accumulation, "
        f"C kernels {isa.variant} on {isa.cpu} [{' '.join(isa.flags)}]"
    )
    say(f"fast CPU path: {description}")
    return WeightsMode("gguf", description)


def _release_packed_dense(model: torch.nn.Module, packed) -> None:
    """Free the float32 copies the packed weights replace (the embedding table stays:
    token lookup reads it, and a tied LM head shares it)."""
    empty = torch.empty(0)
    for layer, p in zip(model.model.layers, packed.layers, strict=True):
        if p.qkv is not None:
            layer.self_attn.qkv_proj.data = empty
        if p.o_proj is not None:
            layer.self_attn.o_proj.data = empty
        if p.gate_up is not None:
            layer.mlp.gate_up_proj.data = empty
        if p.down is not None:
            layer.mlp.down_proj.data = empty
    if packed.lm_head is not None and not model.tie_word_embeddings:
        model.lm_head.data = empty
