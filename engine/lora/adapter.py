"""A PEFT LoRA adapter read from disk: ``adapter_config.json`` + ``adapter_model.safetensors``.

Read once, when it is registered (at start-up or by a load route), checked against the
base model (every tensor names a linear the model has, with its shapes; the rank within
``--max-lora-rank``), and kept on the host in the model dtype. A slot on the device is
filled from it on demand (`engine/lora/manager.py`).

What PEFT features are served: any of q/k/v/o/gate/up/down as targets (layer subsets
too: a module without tensors is simply untargeted), ``lora_alpha / r`` scaling or
rsLoRA's ``lora_alpha / sqrt(r)``, ``rank_pattern`` / ``alpha_pattern``. Refused, with
the reason: DoRA, LoRA biases, ``modules_to_save``, embedding or LM-head targets,
``fan_in_fan_out`` (GPT-2's Conv1D layout) and ``.bin`` checkpoints (pickles).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass(frozen=True, slots=True)
class ModuleLoRA:
    """One targeted module (an HF checkpoint name such as ``model.layers.0.self_attn.q_proj``)."""

    lora_a: torch.Tensor
    """``[r, in]``."""
    lora_b: torch.Tensor
    """``[out, r]``."""
    scale: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: str
    lora_id: int
    """Unique per registration: a re-registered name is a new adapter (its prefix-cache
    blocks are its own)."""
    modules: dict[str, ModuleLoRA] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def cache_key(self) -> bytes:
        """Seeds the prefix-cache hash chain of its requests (engine/block_manager.py)."""
        return f"lora:{self.lora_id}".encode()


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: a pattern matches a module name's dotted suffix."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path / CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{path}: peft_type {peft_type} is not LoRA")
    for key, why in (
        ("use_dora", "DoRA adapters are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layout) is not supported"),
        ("modules_to_save", "modules_to_save (fully trained extra modules) is not supported"),
    ):
        if config.get(key):
            raise AdapterError(f"{path}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: LoRA biases (bias={config['bias']!r}) are not supported")
    return config


HEADER_BYTES = 1 << 20
"""What a safetensors header may add to its tensors' bytes (names, shapes, metadata)."""


def max_adapter_bytes(module_shapes: dict[str, tuple[int, int]], max_rank: int) -> int:
    """The most a servable adapter file can hold: every projection targeted at rank
    `max_rank`, in float64 (8 bytes; PEFT saves 2 or 4), plus a header. A larger file is
    refused before it is read: it is read on the engine's loop, so its size bounds the
    pause (an adapter carrying embeddings or a head would be gigabytes, then refused)."""
    values = sum(max_rank * (n_in + n_out) for n_in, n_out in module_shapes.values())
    return 8 * values + HEADER_BYTES


def _number(value: Any, what: str) -> float:
    """A scaling number of adapter_config.json; the adapter's error (not the engine's
    "name taken" ValueError) when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterError(f"{what} must be a number, not {value!r}")
    return float(value)


def load_adapter(
    name: str,
    path: str,
    lora_id: int,
    module_shapes: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check one adapter. `module_shapes`: each LoRA-capable module of the model
    (HF name) with its (in_features, out_features)."""
    root = Path(path)
    config = read_config(root)
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"{root} has no {WEIGHTS_FILE} (only safetensors adapters load)")
    limit = max_adapter_bytes(module_shapes, max_rank)
    if (size := weights_path.stat().st_size) > limit:
        raise AdapterError(
            f"{name}: {WEIGHTS_FILE} is {size:,} bytes; A and B weights of rank up to "
            f"{max_rank} on this model's projections hold at most {limit:,}"
        )
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:
        raise AdapterError(f"{weights_path} is not a safetensors file ({exc})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{name}: tensor {key!r} is not a LoRA A/B weight")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise AdapterError(f"{name}: {WEIGHTS_FILE} doesn't contain tensors")
    alpha = _number(config.get("lora_alpha", 8), f"{name}: lora_alpha")
    rslora = bool(config.get("use_rslora", False))
    alpha_pattern = config.get("alpha_pattern") or {}
    adapter = LoRAAdapter(name=name, path=str(root), lora_id=lora_id)
    for module, ab in sorted(pairs.items()):
        if module not in module_shapes:
            raise AdapterError(
                f"{name}: targets {module!r}, which is not a q/k/v/o/gate/up/down projection "
                "of this model"
            )
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{name}: {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        in_features, out_features = module_shapes[module]
        rank = int(a.shape[0])
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (rank, in_features)
            or tuple(b.shape) != (out_features, rank)
        ):
            raise AdapterError(
                f"{name}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model "
                f"needs A [r, {in_features}] and B [{out_features}, r]"
            )
        if rank > max_rank:
            raise AdapterError(
                f"{name}: rank {rank} of {module} is greater than max_lora_rank {max_rank} "
                "(--max-lora-rank)"
            )
        module_alpha = _number(
            _pattern_value(alpha_pattern, module, alpha), f"{name}: alpha_pattern of {module}"
        )
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        adapter.modules[module] = ModuleLoRA(a.to(dtype), b.to(dtype), scale)
    return adapter
