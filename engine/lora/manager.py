"""Registered adapters, their resident slots, and the per-step batch (`--enable-lora`).

*Registered* adapters (start-up `--lora-modules`, the model's ``adapters/`` folder, the
load routes) are read and checked once and kept on the host. At most `--max-loras` are
*resident*: copied into one slot of every layer's stacked buffers. A request takes a
slot at admission and holds it (pins it) until it ends, so every admitted request's
adapter stays resident through preemption and recompute; an adapter that is not
resident takes a free slot, else the least recently used unpinned one. When every slot
is pinned by requests of other adapters, admission answers 503 (`NoFreeSlotError`): the
batch cannot take a new adapter until one of them finishes.

Each step the runner hands the scheduled requests' slots to `begin_step`, which builds
the step's `LoRAStep` (per-token slot, grouped) on the shared `LoRAContext` every
`LinearLoRA` reads; a step with no adapter token leaves it None and costs nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from engine.lora.layer import LinearLoRA, LoRAContext
from kernels import LoRAStep

logger = logging.getLogger("hearth.engine")

TARGET_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (every `Linear` of the decoder but the LM head)."""


class AdapterNotFoundError(KeyError):
    """No adapter is registered under this name."""


class NoFreeSlotError(RuntimeError):
    """Every resident slot is pinned by running requests of other adapters."""


@dataclass(slots=True)
class _Slot:
    adapter: LoRAAdapter
    pins: int = 0


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    name: str
    path: str
    rank: int
    resident: bool


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.context = LoRAContext()
        self._next_id = 1
        self.adapters: dict[str, LoRAAdapter] = {}
        self._slots: list[_Slot | None] = [None] * max_loras
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Resident slots with no pins, least recently used first (eviction order)."""
        self._targets: dict[str, tuple[LinearLoRA, int]] = {}
        """HF module name -> (the LoRA hook of the Linear holding it, its shard index)."""
        self.module_shapes: dict[str, tuple[int, int]] = {}
        for module in model.modules():
            if not isinstance(module, Linear):
                continue
            names = [shard.checkpoint for shard in module.shards]
            if not all(name.rsplit(".", 1)[-1] in TARGET_SUFFIXES for name in names):
                continue  # the LM head (and anything else no adapter may target)
            hook = LinearLoRA(
                self.context,
                [shard.rows for shard in module.shards],
                module.in_features,
                max_loras,
                max_rank,
                dtype,
                device,
                native=module.packed is not None,  # on the C kernels: LoRA there too
            )
            module.lora = hook
            for index, shard in enumerate(module.shards):
                self._targets[shard.checkpoint] = (hook, index)
                self.module_shapes[shard.checkpoint] = (module.in_features, shard.rows)

    # -- registry ---------------------------------------------------------------------
    def register(self, name: str, path: str, source: str | None = None) -> LoRAAdapter:
        """Read `path`, check and register; raises AdapterError (bad files, rank, targets)
        or ValueError (the name is taken). `source` (default `path`): where the adapter is
        said to come from, as listed (an s3:// URL whose download `path` is gone)."""
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = load_adapter(
            name, path, self._next_id, self.module_shapes, self.max_rank, self.dtype
        )
        if source is not None:
            adapter.path = source
        self._next_id += 1
        self.adapters[name] = adapter
        logger.info(
            "LoRA adapter %s registered from %s (rank %d, %d modules)",
            name, path, adapter.max_rank, len(adapter.modules),
        )  # fmt: skip
        return adapter

    def unregister(self, name: str) -> None:
        """Forget the name; running requests of it finish on their slot, which is then
        freed (a slot is never reused while pinned)."""
        if self.adapters.pop(name, None) is None:
            raise AdapterNotFoundError(name)
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.adapter.name == name and slot.pins == 0:
                self._free(index)

    def status(self) -> list[AdapterStatus]:
        resident = {s.adapter.lora_id for s in self._slots if s is not None}
        return [
            AdapterStatus(a.name, a.path, a.max_rank, a.lora_id in resident)
            for a in self.adapters.values()
        ]

    # -- slots --------------------------------------------------------------------------
    def acquire(self, name: str) -> tuple[int, bytes]:
        """Pin a slot holding the adapter (loading it on demand): (slot, cache key)."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterNotFoundError(name)
        index = self._resident_slot(adapter)
        if index is None:
            index = self._claim_slot(name)
            self._fill(index, adapter)
        slot = self._slots[index]
        assert slot is not None
        slot.pins += 1
        self._lru.pop(index, None)
        return index, adapter.cache_key

    def release(self, index: int) -> None:
        slot = self._slots[index]
        assert slot is not None and slot.pins > 0, f"slot {index} is not pinned"
        slot.pins -= 1
        if slot.pins:
            return
        if self.adapters.get(slot.adapter.name) is not slot.adapter:
            self._free(index)  # unregistered (or replaced) while it ran
        else:
            self._lru[index] = None  # most recently used at the end

    def _resident_slot(self, adapter: LoRAAdapter) -> int | None:
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.adapter is adapter:
                return index
        return None

    def _claim_slot(self, name: str) -> int:
        for index, slot in enumerate(self._slots):
            if slot is None:
                return index
        if not self._lru:
            raise NoFreeSlotError(
                f"All {self.max_loras} LoRA slots (--max-loras) are in use by running "
                f"requests of other adapters; adapter '{name}' cannot be made resident "
                "now. Retry later."
            )
        index = next(iter(self._lru))
        evicted = self._slots[index]
        assert evicted is not None
        logger.info("LoRA slot %d: %s evicted for %s", index, evicted.adapter.name, name)
        self._free(index)
        return index

    def _free(self, index: int) -> None:
        self._slots[index] = None
        self._lru.pop(index, None)

    def _fill(self, index: int, adapter: LoRAAdapter) -> None:
        hooks = {id(hook): hook for hook, _ in self._targets.values()}
        for hook in hooks.values():
            hook.clear_slot(index)
        for module, lora in adapter.modules.items():
            hook, shard = self._targets[module]
            hook.set_shard(index, shard, lora.lora_a, lora.lora_b, lora.scale)
        self._slots[index] = _Slot(adapter)

    # -- one step ------------------------------------------------------------------------
    def begin_step(self, token_slots: list[int]) -> bool:
        """Set the step's per-token slots (-1: base); True when any token uses an adapter."""
        if all(slot < 0 for slot in token_slots):
            self.context.step = None
            return False
        self.context.step = LoRAStep.build(token_slots, self.device)
        return True

    def end_step(self) -> None:
        self.context.step = None


__all__ = [
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterStatus",
    "LoRAManager",
    "NoFreeSlotError",
]
