"""A GGUF file read as a Hugging Face checkpoint at load: transformers' names and values,
tensor by tensor, straight from the file.

A GGUF's conversion used to write every weight dequantized to float32 into the cache: 4
bytes a weight, 28 GB and ~2.5 minutes for an 8 B Q4_K_M file of 4.6 GB — more disk than
Lambda's /tmp (10 GB) or a small endpoint volume has, for weights the fast path never
reads (it computes from the file's own blocks). Now the conversion keeps the config and the
tokenizer (`WEIGHTS_IN_GGUF` marks such a directory) and the engine reads the weights here:
each tensor dequantized as gguf-py does (`engine/layers/gguf_dequantize.py`) and passed through transformers' own tensor processor
and GGUF name map, so the names and float32 values are exactly what the conversion wrote
(`tests/engine/test_gguf_checkpoint.py` checks them against it).

What transformers' processor does to each tensor is worked out once, by the conversion
(`GGUFLayout`): nothing, or a reordering of rows (Llama's Q and K, and their biases: learnt
by handing it the row numbers instead of the weights), or anything else (Gemma's norms), which
only then makes the engine import transformers' GGUF code (~1.3 s) and run the processor. A
MoE's stacked expert tensors are read a slice per expert, under the per-expert names of the
model's own checkpoints (`_split_experts`).
A linear weight that the fast path will replace by the file's blocks (`unread`) and whose
rows are at most reordered is not dequantized at all: it comes as `GGUFRows`, whose rows
are dequantized only when asked for (the sample rows `engine/layers/gguf_linear.py`
matches against the file), and `read` gives the whole tensor if it is needed after all
(`engine/layers/deferred_weights.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.layers.gguf_dequantize import dequantize
from engine.model_resolver import WEIGHTS_IN_GGUF, ModelNotFoundError, gguf_source

__all__ = ["WEIGHTS_IN_GGUF", "GGUFCheckpoint", "GGUFLayout", "GGUFRows", "WrongShapeError"]


class WrongShapeError(ValueError):
    """A file tensor's shape is not the model parameter's it maps to."""


class GGUFRows:
    """A 2-D GGUF tensor left in its blocks: its shape, and the rows asked for, dequantized
    in the checkpoint's row order (for `DeferredWeights.record`)."""

    def __init__(self, raw: np.ndarray, qtype: Any, order: np.ndarray | None, cols: int) -> None:
        self._raw = raw
        self._qtype = qtype
        self._order = order
        self.shape = torch.Size((raw.shape[0], cols))

    def __getitem__(self, rows: list[int]) -> torch.Tensor:
        index = np.asarray(rows, dtype=np.int64)
        picked = self._raw[index if self._order is None else self._order[index]]
        return torch.from_numpy(np.ascontiguousarray(dequantize(picked, self._qtype)))


AS_IS = "as-is"
"""A tensor transformers' processor leaves as the file has it."""
PROCESSOR = "processor"
"""A tensor the processor changes otherwise than by reordering rows: run it at load."""


@dataclass(frozen=True)
class GGUFLayout:
    """What transformers makes of a GGUF file's tensors for the file's model: names, shapes,
    and what its tensor processor does to each. The conversion child works it out once
    (building transformers' model on the meta device; its GGUF name map alone took ~7 s for
    SmolLM2) and saves it in `WEIGHTS_IN_GGUF`, so the engine needs none of that code."""

    architecture: str
    """The file's `general.architecture` (it picks transformers' tensor processor)."""
    model_class: str
    """transformers' class of the model (for messages)."""
    processor_config: dict[str, Any]
    """The whole config as a dict, defaults included, as the processor is given it."""
    names: dict[str, str]
    """File tensor name -> checkpoint name (transformers' GGUF name map)."""
    shapes: dict[str, list[int]]
    """Checkpoint name -> parameter shape."""
    treatments: dict[str, str | int]
    """File tensor name -> `AS_IS`, `PROCESSOR`, or the index in `orders` of its rows' order."""
    orders: list[list[int]]
    """Row orders (each checkpoint row's file row), each stored once."""
    experts: dict[str, list[str]] = field(default_factory=dict)
    """A parameter of transformers' model that the engine's checkpoint names otherwise ->
    the checkpoint tensors that make it up, which are what `names` maps the file's tensors
    to: an expert stack (Qwen3-MoE's ``mlp.experts.gate_up_proj``) -> its per-expert
    matrices (`_split_experts`); Mixtral's ``mlp.gate`` -> its checkpoints'
    ``block_sparse_moe.gate``."""

    @classmethod
    def of_config(cls, config: Any, arch: str, source: Any) -> tuple[GGUFLayout, Any]:
        """The layout of `source` (`GGUFSource`) for a transformers `config` of the file's
        model, and that model built on the meta device (in the conversion child, whose
        `_memoize_gguf_parsing` makes the name map cheap)."""
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        processor_config = json.loads(config.to_json_string(use_diff=False))
        processor = _processor(arch, processor_config)
        # A Mixtral file is a "llama" one: gguf-py's Llama names, which include the experts'
        model_type = "llama" if config.model_type == "mixtral" else None
        names = get_gguf_hf_weights_map(model, processor, model_type=model_type)
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        slices, experts = _split_experts(config.model_type, source, names, shapes)
        if config.model_type == "mixtral":
            experts.update(_mixtral_routers(names, shapes))
        orders: dict[tuple[int, ...], int] = {}
        treatments: dict[str, str | int] = {}
        for name in source.tensors:
            if name in slices:
                treatments.update(dict.fromkeys(slices[name], AS_IS))
            else:
                treatments[name] = _treatment(processor, names, name, source, orders)
        layout = cls(
            architecture=arch,
            model_class=type(model).__name__,
            processor_config=processor_config,
            names=names,
            shapes=shapes,
            treatments=treatments,
            orders=[list(order) for order in orders],
            experts=experts,
        )
        return layout, model

    def save(self, directory: Path) -> None:
        (directory / WEIGHTS_IN_GGUF).write_text(json.dumps(asdict(self)) + "\n")

    @classmethod
    def load(cls, directory: Path) -> GGUFLayout:
        return cls(**json.loads((directory / WEIGHTS_IN_GGUF).read_text()))


_STACKED_EXPERTS = {
    "qwen3_moe": (
        "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
        {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
    ),
    "mixtral": (
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
    ),
}
"""Model types whose file stacks each layer's experts in one tensor per projection
(`EXPERT_TENSORS`): the checkpoint name of one expert's matrix, and each stacked tensor's
projection in it."""
_STACKED = re.compile(r"blk\.(\d+)\.(ffn_\w+_exps)\.weight")
_FUSED_PARAMETER = {
    "ffn_gate_exps": "gate_up_proj",
    "ffn_up_exps": "gate_up_proj",
    "ffn_down_exps": "down_proj",
}
"""transformers' parameter (`model.layers.L.mlp.experts.*`) that holds each stacked tensor,
where its GGUF name map does not say (Mixtral's gate and up under the "llama" names)."""


def _split_experts(
    model_type: str, source: Any, names: dict[str, str], shapes: dict[str, list[int]]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Read a stacked expert tensor ``[experts, rows, columns]`` as one matrix per expert,
    under the per-expert names of the model's checkpoints on the hub, which is also what
    the engine loads: `names` and `shapes` gain each slice (`expert_slice`) and its
    checkpoint name. transformers' processor instead copies a layer's gate and up tensors
    into one parameter ``[experts, 2 * rows, columns]``, whose halves are those slices.
    Returns the slices of each stacked file tensor, and each stacked parameter's parts."""
    from engine.layers.gguf_linear import expert_slice

    slices: dict[str, list[str]] = {}
    experts: dict[str, list[str]] = {}
    if model_type not in _STACKED_EXPERTS:
        return slices, experts
    template, projection = _STACKED_EXPERTS[model_type]
    for name, (dims, _, _) in source.tensors.items():
        m = _STACKED.fullmatch(name)
        if m is None or m.group(2) not in projection or len(dims) != 3:
            continue
        # transformers keys these by the name less ".weight" (its processor's lookup)
        stacked = names.pop(name, None) or names.pop(name.removesuffix(".weight"), None)
        if stacked is None:
            fused = f"model.layers.{m.group(1)}.mlp.experts.{_FUSED_PARAMETER[m.group(2)]}"
            stacked = fused if fused in shapes else None
        if stacked is None:
            continue
        slices[name] = []
        for e in range(int(dims[2])):
            hf_name = template.format(layer=m.group(1), expert=e, proj=projection[m.group(2)])
            names[expert_slice(name, e)] = hf_name
            shapes[hf_name] = [int(dims[1]), int(dims[0])]
            slices[name].append(expert_slice(name, e))
            experts.setdefault(stacked, []).append(hf_name)
    return slices, experts


_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


def _mixtral_routers(names: dict[str, str], shapes: dict[str, list[int]]) -> dict[str, list[str]]:
    """Mixtral's routers under its checkpoints' name (``block_sparse_moe.gate``, what the
    engine loads) where transformers says ``mlp.gate``: `names` and `shapes` renamed, and
    each transformers parameter -> its new name (`GGUFLayout.experts`)."""
    renamed: dict[str, list[str]] = {}
    for file_name, hf_name in list(names.items()):
        if (m := _ROUTER.fullmatch(hf_name)) is not None:
            new = f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"
            names[file_name] = new
            shapes[new] = shapes[hf_name]
            renamed[hf_name] = [new]
    return renamed


def _processor(arch: str, processor_config: dict[str, Any]) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=processor_config)


def _process(processor: Any, names: dict[str, str], name: str, weights: np.ndarray) -> Any:
    return processor.process(
        weights=weights, name=name, tensor_key_mapping=names, parsed_parameters={"tensors": {}}
    )


def _treatment(
    processor: Any,
    names: dict[str, str],
    name: str,
    source: Any,
    orders: dict[tuple[int, ...], int],
) -> str | int:
    """What `processor` does to file tensor `name`, found by handing it the row numbers in
    the tensor's place (a vector's, or a matrix's as one column): left alone, reordered (a
    permutation of them), or anything else — values, shape or name changed, or a tensor of
    more dimensions — `PROCESSOR`."""
    dims = source.tensors[name][0]
    if len(dims) > 2:
        return PROCESSOR
    rows = int(dims[-1])
    numbers = np.arange(rows, dtype=np.float64).reshape(rows, *[1] * (len(dims) - 1))
    result = _process(processor, names, name, numbers.copy())
    got = np.asarray(result.weights)
    if result.name != name or got.shape != numbers.shape:
        return PROCESSOR
    if np.array_equal(got, numbers):
        return AS_IS
    order = got.reshape(rows)
    if not np.array_equal(np.sort(order), np.arange(rows)):
        return PROCESSOR
    return orders.setdefault(tuple(int(i) for i in order), len(orders))


class GGUFCheckpoint:
    """The tensors of `gguf_path` under the names and in the layout transformers gives them
    (`GGUFLayout`)."""

    def __init__(self, gguf_path: Path, layout: GGUFLayout, source: Any = None) -> None:
        from engine.layers.gguf_linear import GGUFSource

        self.path = gguf_path
        self.layout = layout
        self.source = source if source is not None else GGUFSource(gguf_path)
        self.expected = {n: tuple(shape) for n, shape in layout.shapes.items()}
        self._orders = [np.asarray(order, dtype=np.int64) for order in layout.orders]
        self._processor: Any = None
        self._origin: dict[str, str] = {}
        """Checkpoint name -> file tensor name, for those `tensors` yielded."""

    @classmethod
    def of_directory(cls, model_dir: str | Path) -> GGUFCheckpoint | None:
        """The checkpoint of a converted directory whose weights stay in its GGUF file, or
        None for a directory with weights of its own. A directory marked so whose file is
        gone is an error naming the file."""
        if not (Path(model_dir) / WEIGHTS_IN_GGUF).is_file():
            return None
        source = gguf_source(model_dir)
        if source is None:
            raise ModelNotFoundError(
                f"{str(model_dir)!r} reads its weights from a GGUF file that is gone (see its "
                "hearth-conversion.json); serve the .gguf file itself again"
            )
        return cls(source, GGUFLayout.load(Path(model_dir)))

    def tensors(self, unread: Collection[str] = ()) -> Iterator[tuple[str, Any]]:
        """Yield `(name, tensor)` for every file tensor the model has a place for, in file
        order, one at a time (float32 CPU tensors); names in `unread` come as `GGUFRows`
        where the processor at most reorders their rows. Raises `WrongShapeError` for a
        tensor of the wrong shape. (One at a time: the common formats dequantize in C on the
        OpenMP threads; gguf-py's numpy, for the rest, ran at 117 M values/s alone and 77 M/s
        on two threads of a 2-vCPU host.)"""
        for name in self.layout.treatments:
            if (found := self._entry(name, unread)) is not None:
                yield found

    def _entry(self, name: str, unread: Collection[str]) -> tuple[str, Any] | None:
        """File tensor `name` as `tensors` yields it: left in its blocks (`GGUFRows`), or
        dequantized; None when the model has no place for it."""
        treatment = self.layout.treatments[name]
        hf_name = self.layout.names.get(name)
        if hf_name in unread and treatment != PROCESSOR:
            qtype, raw = self.source.stored(name)
            cols = self.source.dims(name)[0]
            self._check_shape(name, hf_name, (raw.shape[0], cols))
            found: tuple[str, Any] | None = (
                hf_name,
                GGUFRows(
                    raw, qtype, None if treatment == AS_IS else self._orders[int(treatment)], cols
                ),
            )
        else:
            found = self._dequantized(name)
        if found is not None:
            self._origin[found[0]] = name
        return found

    def read(self, name: str) -> torch.Tensor:
        """The whole checkpoint tensor `name` (one `tensors` yielded), dequantized."""
        found = self._dequantized(self._origin[name])
        assert found is not None and found[0] == name, name
        return found[1]

    def _dequantized(self, name: str) -> tuple[str, torch.Tensor] | None:
        """File tensor `name` dequantized and treated as transformers would, with its
        checkpoint name; None when the model has no place for it."""
        treatment = self.layout.treatments[name]
        qtype, raw = self.source.stored(name)
        weights = dequantize(raw, qtype)
        if treatment == PROCESSOR:
            if self._processor is None:
                self._processor = _processor(self.layout.architecture, self.layout.processor_config)
            result = _process(self._processor, self.layout.names, name, weights)
            weights, name_now = result.weights, result.name
        else:
            if treatment != AS_IS:
                weights = weights[self._orders[int(treatment)]]
            name_now = name
        hf_name = self.layout.names.get(name_now) if name_now is not None else None
        if hf_name is None or hf_name not in self.expected:
            return None
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if not weights.flags.writeable:  # an F32 tensor is a view of the read-only file
            weights = weights.copy()
        self._check_shape(name, hf_name, weights.shape)
        return hf_name, torch.from_numpy(weights)

    def _check_shape(self, name: str, hf_name: str, shape: tuple[int, ...]) -> None:
        if tuple(shape) != self.expected[hf_name]:
            raise WrongShapeError(
                f"{self.path.name} ({self.layout.architecture}): tensor {name} is {list(shape)}, "
                f"{self.layout.model_class}'s {hf_name} is {list(self.expected[hf_name])}"
            )
