"""GGUF blocks as a linear method: the file's own Q4_1/Q8_0 weights through the C kernels
(F16 / BF16 tensors as 16-bit weights; Q4_0, K-quants and the rest re-laid as Q4_1 or Q8_0
blocks by `engine/layers/gguf_relayout.py`).

The default model ships as a Q4_1 GGUF (token embedding Q8_0). The float32 model the
engine loads is that file dequantized, so computing straight from the blocks is the same
function with ~1/6 of the bytes per weight: a decode step streams ~95 MB instead of
540 MB. `GGUFBlockLinearMethod.pack` finds each `Shard` of a `Linear` in the file by its
checkpoint name, puts the rows in the order of the Hugging Face layout, and packs them for
its kernel; `apply` runs the quantized GEMM. Two methods share that:

- `GGUFBlockLinearMethod` (``--quantization gguf``, the default for a GGUF on CPU):
  float32 activations and accumulation (``kernels/cpu/hearth_cpu.c``), the dequantized
  model's function up to the order of float32 sums;
- `GGUFTiledLinearMethod` (``--quantization gguf-bf16``): the blocks plus a bfloat16 copy
  in AMX tiles (``kernels/cpu/hearth_bf16.c``); calls of 16 tokens and more (prefill,
  batched decode) run on the matrix unit with bfloat16 operands and float32 sums, smaller
  ones on the float32 block kernel;
- `GGUFInt8LinearMethod` (``--quantization gguf-int8``, opt-in): activations quantized to
  int8 per token and 32-column block (llama.cpp's Q8_1), integer block dot products by
  AMX tiles, AVX512-VNNI or AVX2 (``kernels/cpu/hearth_q8.c``); the same bits on every
  ISA, batch size and thread count, but below the quality bar on SmolLM2.

The blocks come from a `BlockSource`: a GGUF file (`GGUFSource`), or, for a model that
ships as safetensors alone, its own weights in 16 bits (`engine/layers/half_weights.py`) or,
asked for by name, quantized to Q8_0 at load (`engine/layers/q8_0_weights.py`).

Row order in a file is not assumed: llama.cpp's converter permutes the rows of Q and K for some
architectures, and transformers undoes it on load. For every tensor, sample rows are
dequantized with gguf-py and compared bit for bit with the float32 weights already
loaded, under the identity and under transformers' reverse permutation; a layer with a
tensor that matches neither (or is F32) keeps its dense method.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from engine.layers.deferred_weights import sample_rows
from engine.layers.gguf_dequantize import dequantize
from engine.layers.gguf_relayout import LaidRows, Relayout, as_q8_0
from engine.layers.linear import Linear, LinearMethod
from kernels.cpu import bf16_ops, ops, q8_ops

__all__ = [
    "EXPERT_TENSORS",
    "BlockSource",
    "GGUFBlockLinearMethod",
    "GGUFInt8LinearMethod",
    "GGUFSource",
    "GGUFTiledLinearMethod",
    "expert_slice",
    "fits_kernels",
    "gather_table_from_blocks",
    "gguf_tensor_name",
    "split_expert",
]

logger = logging.getLogger("hearth.engine")

_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused checkpoint tensors, stored fused
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
"""Hugging Face module names inside a decoder layer → llama.cpp's tensor names."""
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
EXPERT_TENSORS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",  # Mixtral's names of the same three
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
"""A per-expert module (Qwen3-MoE's ``mlp.experts.E.gate_proj``, Mixtral's
``block_sparse_moe.experts.E.w1``, ...) → the llama.cpp tensor that stacks every expert's
weight of a layer: ``[experts, rows, columns]``."""
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
_SLICE = re.compile(r"(.+)\[(\d+)\]")


def expert_slice(tensor: str, expert: int) -> str:
    """The name of expert `expert`'s matrix in the stacked file tensor `tensor`, as
    `GGUFSource` reads it: ``blk.0.ffn_up_exps.weight[3]``."""
    return f"{tensor}[{expert}]"


def split_expert(name: str) -> tuple[str, int | None]:
    """`expert_slice`'s inverse: the file tensor and the expert, or `name` and None."""
    m = _SLICE.fullmatch(name)
    return (name, None) if m is None else (m.group(1), int(m.group(2)))


def gguf_tensor_name(checkpoint: str) -> str | None:
    """llama.cpp's name of the weight of HF module `checkpoint` (an expert's: its slice of
    the layer's stacked tensor), or None if it has none."""
    if checkpoint == "model.embed_tokens":
        return "token_embd.weight"
    if checkpoint == "lm_head":
        return "output.weight"
    m = _LAYER.fullmatch(checkpoint)
    if m is None:
        return None
    if (e := _EXPERT.fullmatch(m.group(2))) is not None and e.group(2) in EXPERT_TENSORS:
        return expert_slice(
            f"blk.{m.group(1)}.{EXPERT_TENSORS[e.group(2)]}.weight", int(e.group(1))
        )
    if m.group(2) not in _LAYER_TENSORS:
        return None
    return f"blk.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"


def _reverse_permute_rows(n: int, heads: int) -> np.ndarray:
    """Row order transformers' GGUF loader applies to Q/K (undoing llama.cpp's permute)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


_UNREAD_KINDS = {0, 24, 25, 26, 27, 28}
"""GGML type ids that stay dense: F32 (asked for as full precision) and the integer and
float64 types; every other type is read as stored or re-laid (`engine/layers/gguf_relayout.py`)."""
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value types of fixed size (8 = string and 9 = array are variable)."""


class GGUFSource:
    """Tensor index of a GGUF file, read straight from its header.

    gguf-py's reader also decodes every metadata field into numpy views (the 49k-token
    vocabulary alone is ~100k of them), which took seconds; only the tensor table is
    needed here, so the metadata is skipped with plain `struct` reads.
    """

    def __init__(self, path: Path) -> None:
        import struct

        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        buf = self.data
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        pos = 24
        alignment = 32

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def skip_value(kind: int, at: int) -> int:
            if kind in _SCALAR_BYTES:
                return at + _SCALAR_BYTES[kind]
            if kind == 8:
                (n,) = struct.unpack_from("<Q", buf, at)
                return at + 8 + n
            if kind == 9:
                elem, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if elem in _SCALAR_BYTES:
                    return at + count * _SCALAR_BYTES[elem]
                for _ in range(count):
                    at = skip_value(elem, at)
                return at
            raise ValueError(f"unknown GGUF metadata type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if key == "general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", buf, pos)
            pos = skip_value(kind, pos)
        infos: list[tuple[str, list[int], int, int]] = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
        start = -(-pos // alignment) * alignment
        self.tensors = {name: (dims, kind, start + offset) for name, dims, kind, offset in infos}
        self.relayout = Relayout()

    def dims(self, name: str) -> list[int]:
        """`name`'s dimensions, ggml's order (columns first); an expert's slice
        (`expert_slice`) has its tensor's but the last."""
        base, expert = split_expert(name)
        dims = [int(d) for d in self.tensors[base][0]]
        return dims if expert is None else dims[:-1]

    def stored(self, name: str) -> tuple[GGMLQuantizationType, np.ndarray]:
        """`name`'s type and bytes, shaped as gguf-py's reader shapes them: `[*outer dims,
        row bytes]` (what `gguf.dequantize` takes); an expert's slice is its tensor's
        `[expert]`."""
        base, expert = split_expert(name)
        if expert is not None:
            qtype, data = self.stored(base)
            return qtype, data[expert]
        dims, kind, offset = self.tensors[name]
        qtype = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = int(dims[0]) // block * block_bytes
        outer = [int(d) for d in reversed(dims[1:])]
        count = int(np.prod(outer, dtype=np.int64)) if outer else 1
        # A plain ndarray view, not np.memmap: gguf-py slices a tensor into thousands of
        # views, and each memmap view ran a Python __array_finalize__ (1.3 s of a 0.8 B
        # model's load).
        data = self.data[offset : offset + count * row_bytes].view(np.ndarray)
        return qtype, data.reshape(*outer, row_bytes)

    def raw(self, name: str) -> tuple[str, np.ndarray] | None:
        """`name`'s rows as stored (uint8, [rows, row bytes]) and their GGML type's name
        (lower case), for a 2-D tensor (or an expert's slice of a stacked one) of whole
        32-column blocks in a format the kernels read or `relaid_rows` re-lays."""
        base, expert = split_expert(name)
        info = self.tensors.get(base)
        if info is None or (expert is not None and expert >= info[0][-1]):
            return None
        dims, kind_id = self.dims(name), info[1]
        try:
            qtype = GGMLQuantizationType(kind_id)
        except ValueError:
            return None
        if kind_id in _UNREAD_KINDS or qtype not in GGML_QUANT_SIZES or len(dims) != 2:
            return None
        if dims[0] % 32 or dims[0] % GGML_QUANT_SIZES[qtype][0]:
            return None
        return qtype.name.lower(), self.stored(name)[1]

    def describe(self) -> str:
        relaid = self.relayout.summary()
        return f"GGUF blocks of {self.path.name}" + (f" ({relaid})" if relaid else "")

    def rows(self, layer: Linear, row_multiple: int) -> LaidRows | None:
        """`layer`'s rows from the file in the loaded weights' row order, as stored, or None
        when the file can't provide every shard in one kernel-supported block kind (the
        packers check `row_multiple` themselves: a file's weights are never rewritten)."""
        parts = []
        for shard, start in layer.shard_offsets():
            name = gguf_tensor_name(shard.checkpoint)
            if name == "output.weight" and name not in self.tensors:
                name = "token_embd.weight"  # GGUFs may drop a duplicate head
            dense = layer.weight.narrow(0, start, shard.rows)
            parts.append(None if name is None else _ordered(self, name, dense, shard.rotary_heads))
        if any(p is None for p in parts):
            return None
        laid = LaidRows.of([p for p in parts if p is not None])
        if laid is not None:
            laid.describe_into(self.relayout)
        return laid


def _rows_match(kind: str, raw: np.ndarray, dense: torch.Tensor) -> bool:
    qtype = GGMLQuantizationType[kind.upper()]
    rows = sample_rows(raw.shape[0])
    try:
        got = torch.from_numpy(dequantize(raw[rows], qtype))
    except NotImplementedError:  # a type gguf-py can't dequantize: nothing to check against
        return False
    return bool(got.shape == dense[rows].shape and torch.equal(got, dense[rows].float()))


def _ordered(
    src: GGUFSource, name: str, dense: torch.Tensor, heads: int | None
) -> tuple[str, np.ndarray] | None:
    """`name`'s raw rows in the dense weight's order, or None when they can't be matched."""
    found = src.raw(name)
    if found is None:
        return None
    kind, raw = found
    if raw.shape[0] != dense.shape[0]:
        return None
    candidates = [raw]
    if heads:
        candidates.append(raw[_reverse_permute_rows(raw.shape[0], heads)])
    for rows in candidates:
        if _rows_match(kind, rows, dense):
            return kind, np.ascontiguousarray(rows)
    logger.warning("GGUF tensor %s does not match the loaded weights; using float32", name)
    return None


def gather_table_from_blocks(model: nn.Module, source: GGUFSource) -> str:
    """Give the token embedding the file's own rows in place of its float32 table, when
    its sample rows match the loaded table bit for bit: F16 or BF16 rows, or the rows of
    any format the C dequantizer reads (Q8_0, Q4_0 to Q5_1, Q4_K to Q6_K), as stored (the C
    gather dequantizes a row exactly as gguf-py does: the same values in 1/2 to 1/7 of the
    bytes; until stop 46 all but Q8_0 were quantized again to Q8_0), any other quantized
    format requantized to Q8_0 rows (`engine/layers/gguf_relayout.py`; counted in the
    source's summary). A tied LM head
    already packed drops its reference to the float32 table, so the table is freed.
    Returns what the engine's log says of it ("" when the table stays float32)."""
    from engine.layers.embedding import VocabEmbedding

    found = source.raw("token_embd.weight")
    if found is None:
        return ""
    stored, raw = found
    said = ""
    for module in model.modules():
        old = getattr(module, "weight", None)
        if not isinstance(module, VocabEmbedding) or not isinstance(old, torch.Tensor):
            continue
        if raw.shape[0] != old.shape[0] or old.dtype != torch.float32:
            continue
        if not _rows_match(stored, raw, old):
            continue
        if stored in ops.WIDE_KINDS or ops.dequantizes(stored):
            kind, rows = stored, raw
        else:
            kind, rows = "q8_0", as_q8_0(stored, raw)
        source.relayout.record(stored, kind)
        module.weight = nn.Parameter(_table(kind, rows), requires_grad=False)
        module.blocks = kind  # read for a table of block rows only
        for linear in model.modules():
            if isinstance(linear, Linear) and linear.weight is old and linear.packed is not None:
                linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        said = f"token table as {'its ' * (kind == stored)}{kind.upper()} rows"
    return said


def _table(kind: str, rows: np.ndarray) -> torch.Tensor:
    """An embedding table of the C gather's kinds from rows as stored: GGUF block rows stay
    uint8, 16-bit rows become float16 / bfloat16 `[vocab, hidden]`. Rows read from the file
    stay in its mapping, as the packed linears' sources do until packed: the gather only
    reads them, and a copy was anonymous memory the kernel can't drop (a 128k-token Q4_K
    table: 0.3 GB) and a second of a big model's start on this VM's slow fresh memory."""
    with warnings.catch_warnings():  # read-only: nothing writes a gathered table
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        table = torch.from_numpy(np.ascontiguousarray(rows))
    if kind == "f16":
        return table.view(torch.float16)
    if kind == "bf16":
        return table.view(torch.bfloat16)
    return table


def fits_kernels(weight: torch.Tensor, row_multiple: int) -> bool:
    """Whether the kernels can take a `[rows, k]` weight: k whole 32-column blocks, rows
    whole groups of `row_multiple` (a two-label classifier head is not)."""
    return (
        weight.dim() == 2
        and weight.numel() > 0
        and weight.shape[1] % 32 == 0
        and weight.shape[0] % row_multiple == 0
    )


class BlockSource(Protocol):
    """Where a linear's blocks come from: a GGUF file (`GGUFSource`), or the checkpoint's
    weights in 16 bits (`engine.layers.half_weights.HalfWeights`) or quantized at load
    (`engine.layers.q8_0_weights.QuantizedWeights`)."""

    def describe(self) -> str: ...

    def rows(self, layer: Linear, row_multiple: int) -> LaidRows | None: ...


class GGUFBlockLinearMethod(LinearMethod):
    """Q4_1 / Q8_0 blocks, float32 accumulation (hearth_cpu.c)."""

    name = "gguf"
    row_multiple = ops.GROUP
    """Rows per packed group of the kernel (a weight of other height keeps its dense method)."""
    reads_dense = False
    """Whether packing reads the layer's dense weight (beyond the rows matched with the file)."""

    def __init__(self, source: BlockSource) -> None:
        self.source = source

    def _pack(self, layer: Linear, rows: LaidRows) -> object:
        return rows.pack(layer.bias)

    def pack(self, layer: Linear) -> object | None:
        """`layer`'s weight packed for the kernel, or None when the source can't provide
        every row in one kernel-supported block kind."""
        found = self.source.rows(layer, self.row_multiple)
        if found is None:
            return None
        try:
            return self._pack(layer, found)
        except ValueError:
            return None

    @staticmethod
    def _kernel(x: torch.Tensor, packed) -> torch.Tensor:
        return ops.linear(x, packed)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The method's kernel on its own packed weight (each subclass packs and runs its
        own layout: `_pack` and `_kernel`)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._kernel(x, layer.packed)


class GGUFTiledLinearMethod(GGUFBlockLinearMethod):
    """The blocks for small calls plus the dequantized weight rounded to bfloat16 in AMX
    tiles for calls of `min_t` tokens and more (``kernels/cpu/hearth_bf16.c``; None: the
    tile path's default, `bf16_ops.default_min_t`)."""

    name = "gguf-bf16"
    reads_dense = True  # the bfloat16 tiles are the dense weight rounded

    def __init__(self, source: BlockSource, min_t: int | None = None) -> None:
        super().__init__(source)
        self.min_t = bf16_ops.default_min_t() if min_t is None else min_t

    def _pack(self, layer: Linear, rows: LaidRows) -> object:
        if bf16_ops.qtiles_path():  # AMX's Q-tiles read the re-laid rows whole: re-lay once
            raw = rows.joined()
            blocks = ops.pack(rows.kind, raw, layer.bias)
        else:
            raw, blocks = None, rows.pack(layer.bias)
        return bf16_ops.pack_tiles(layer.weight.float(), blocks, self.min_t, raw=raw)

    @staticmethod
    def _kernel(x: torch.Tensor, packed) -> torch.Tensor:
        return bf16_ops.linear_tiles(x, packed)


class GGUFInt8LinearMethod(GGUFBlockLinearMethod):
    """The same blocks with int8 activations: integer dot products per 32-column block,
    scaled and summed in float32 in one fixed order (``kernels/cpu/hearth_q8.c``)."""

    name = "gguf-int8"
    row_multiple = q8_ops.ROW_MULTIPLE

    def _pack(self, layer: Linear, rows: LaidRows) -> object:
        return q8_ops.pack_q8act(rows.kind, rows.joined(), layer.bias)

    @staticmethod
    def _kernel(x: torch.Tensor, packed) -> torch.Tensor:
        return q8_ops.linear_q8act(x, packed)
