"""Q8_0 blocks made from a checkpoint's own weights, for models that ship no GGUF.

The CPU fast path computes from GGUF blocks (engine/layers/gguf_linear.py). A model that
comes as safetensors alone (a fine-tuned Llama, Qwen3, a classifier or reranker) runs it
from its own weights in 16 bits by default (engine/layers/half_weights.py). Asked for by
name (``--quantization q8_0``, and ``gguf-int8``, whose integer kernels read blocks only),
`QuantizedWeights` quantizes each linear's loaded weight to llama.cpp's Q8_0 at start-up (32 columns per block, one
float16 scale, ``round(w / d)`` with ``d = max|w| / 127``) by gguf-py's quantizer, bit for
bit ggml's reference: the same model written as a Q8_0 GGUF by llama.cpp's converter packs
into the same blocks and computes the same bits.

The loaded weight is then overwritten with its dequantized blocks, as a GGUF's dense
model is the file dequantized: everything else that reads it (a token embedding tied to
the LM head, the bfloat16 tiles of ``gguf-bf16``) sees the weights the kernels compute
with (LoRA adds its own term after the method, whichever it is).

Q8_0, not Q4_1: the finest blocks the kernels read. It is still a rounding of the
checkpoint (SmolLM2-135M on the docs' corpus: KL 1.2e-3 nat/token, perplexity +0.15 %,
top-1 98.1 %, under the 99 % bar), so only a mode named by the user runs it.

Quantizing and rewriting the weights are vectorized numpy / torch passes (1.5 s for
SmolLM2's 135M weights on a 2-vCPU Zen 3), of the order of packing the blocks, which the
GGUF path already does at start-up, so nothing is cached on disk.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.layers.gguf_linear import fits_kernels
from engine.layers.gguf_relayout import LaidRows
from engine.layers.linear import Linear

__all__ = ["QBLOCK", "QuantizedWeights", "dequantize_q8_0", "quantize_q8_0"]

QBLOCK = 32
"""Columns per Q8_0 block."""
_BLOCK_BYTES = 2 + QBLOCK
_ROWS_PER_CHUNK = 1024
"""Rows quantized at once: bounds the float32 temporaries (a few copies of a chunk)."""


def quantize_q8_0(weight: torch.Tensor) -> np.ndarray:
    """`weight` (``[rows, k]``, k a multiple of 32) as GGUF Q8_0 rows: uint8
    ``[rows, k/32 * 34]``, each block its float16 scale then 32 int8 values (gguf-py's
    quantizer, a chunk of rows at a time)."""
    rows, k = weight.shape
    if k % QBLOCK:
        raise ValueError(f"Q8_0 needs the columns to be a multiple of {QBLOCK}, not {k}")
    out = np.empty((rows, k // QBLOCK * _BLOCK_BYTES), dtype=np.uint8)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = weight[start : start + _ROWS_PER_CHUNK].detach().to(torch.float32).numpy()
        out[start : start + chunk.shape[0]] = quantize(chunk, GGMLQuantizationType.Q8_0)
    return out


def dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    """Q8_0 rows back to float32 ``[rows, k]`` (``d * q``, gguf-py's dequantizer)."""
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))


class QuantizedWeights:
    """The block source of a model without a GGUF: each linear's own weight as Q8_0."""

    def describe(self) -> str:
        return "Q8_0 blocks quantized at load from the checkpoint's weights"

    def rows(self, layer: Linear, row_multiple: int) -> LaidRows | None:
        """`layer`'s weight as Q8_0 rows (and the weight replaced by their dequantized
        values), or None when the kernel can't take its shape: columns not whole blocks,
        or rows not whole groups of `row_multiple` (a classifier's two-label head keeps its
        dense method)."""
        weight = layer.weight
        if not fits_kernels(weight, row_multiple):
            return None
        rows = weight.shape[0]
        raw = quantize_q8_0(weight.detach())
        with torch.no_grad():
            for start in range(0, rows, _ROWS_PER_CHUNK):
                part = raw[start : start + _ROWS_PER_CHUNK]
                weight[start : start + part.shape[0]].copy_(dequantize_q8_0(part))
        return LaidRows("q8_0", (("q8_0", raw),))
