"""MXFP4 expert tensors (the released gpt-oss checkpoints) → dense tensors, once at load.

hearth has no MXFP4 kernel: the experts are dequantized on the way into the loader, to
the model's dtype and on its device, and then load as a dense checkpoint's would. The
layout and arithmetic mirror transformers' reader op for op
(``transformers/integrations/mxfp4.py``: `FP4_VALUES`, `convert_moe_packed_tensors`), so
the weights are bitwise the ones transformers serves the same checkpoint with
(tests/engine/test_mxfp4.py checks it):

- ``<name>_blocks``, uint8 ``[E, rows, G, 16]``: a block is 32 values, two FP4 (E2M1)
  codes per byte, the low nibble the even element and the high nibble the odd one;
  code → value by `FP4_VALUES` (sign bit 8, so code 8 is -0.0);
- ``<name>_scales``, uint8 ``[E, rows, G]``: one E8M0 exponent per block, biased by 127
  (value = ``FP4_VALUES[code] * 2 ** (scale - 127)``, by ``torch.ldexp``);
- a row is its G blocks end to end, so each expert is ``[rows, G * 32]``, i.e.
  ``[out, in]``; the dense tensor is that transposed, ``[E, in, out]``, the layout a
  dense checkpoint stores (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]).

The dequantization runs one expert at a time into the layer's output, so its temporaries
(the nibble indices) stay one expert's size, as transformers bounds them by chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["FP4_VALUES", "dequantize_mxfp4", "dequantize_mxfp4_tensors"]

FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""The 16 FP4 (E2M1) values by code: bit 3 the sign, bits 0-2 the magnitude."""

_BYTES_PER_BLOCK = 16
"""32 FP4 values, two per byte."""

_SCALE_BIAS = 127
"""E8M0: the scale byte is the exponent plus 127."""

_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`blocks` ``[..., G, 16]`` with their `scales` ``[..., G]`` as `dtype` values
    ``[..., G * 32]`` (on the blocks' device): transformers' `_convert_moe_packed_tensors`
    before its final transpose, the same ops in the same dtypes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != _BYTES_PER_BLOCK or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(want blocks [..., G, {_BYTES_PER_BLOCK}] and scales [..., G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    exponent = scales.to(device=blocks.device, dtype=torch.int32) - _SCALE_BIAS
    out = torch.empty(*blocks.shape[:-1], 2 * _BYTES_PER_BLOCK, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]  # low nibble: the even element
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exponent.unsqueeze(-1), out=out)
    return out.flatten(-2)


def _dense(
    name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Stacked experts' `blocks` ``[E, rows, G, 16]`` and `scales` ``[E, rows, G]`` as the
    dense ``[E, G * 32, rows]`` tensor (a transposed view), one expert at a time."""
    if blocks.dim() != 4:
        raise ValueError(
            f"MXFP4 tensor {name}_blocks has shape {tuple(blocks.shape)}, "
            f"expected [experts, rows, blocks, {_BYTES_PER_BLOCK}]"
        )
    num_experts, rows, num_blocks, _ = blocks.shape
    out = torch.empty(
        num_experts, rows, num_blocks * 2 * _BYTES_PER_BLOCK, dtype=dtype, device=device
    )
    for e in range(num_experts):
        try:
            out[e] = dequantize_mxfp4(blocks[e].to(device), scales[e].to(device), dtype)
        except ValueError as exc:
            raise ValueError(f"MXFP4 tensor {name}: {exc}") from None
    return out.transpose(1, 2)  # [E, in, out], as transformers (which copies it contiguous)


def dequantize_mxfp4_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each ``<name>_blocks`` / ``<name>_scales`` pair
    replaced by the dense ``<name>`` (`dtype`, on `device`, ``[E, in, out]``); every
    other tensor passes through. The two halves pair up in whichever order and shard
    they come; a half left without its partner at the end is an error naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        halves = pending.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) == len(_SUFFIXES):
            del pending[base]
            yield base, _dense(base, halves["_blocks"], halves["_scales"], dtype, device)
    for base, halves in pending.items():
        (have,) = halves
        missing = next(s for s in _SUFFIXES if s != have)
        raise ValueError(f"MXFP4 tensor {base}{have} has no {base}{missing} in the checkpoint")
