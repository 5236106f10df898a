"""A GGUF model's linear weights and token table left unread at load
(engine/layers/deferred_weights.py), from a converted directory and from the file itself:
the sample rows the file is matched against are the checkpoint's, the engine packs the same
blocks and computes the same logits as one that read everything, and whatever is not packed
is read in full before it is used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.layers.deferred_weights import sample_rows
from engine.layers.linear import Linear
from engine.model_loader import load_model
from kernels.cpu import ops
from tests.engine.test_gguf_relayout import VOCAB, _llama_256

pytestmark = pytest.mark.skipif(
    not ops.available(), reason="host has no AVX2: the fast path does not run here"
)


def _converted(directory: Path, config, qtype: str, checkpoint: str = "in-file") -> Path:
    """`config` saved with random weights, written as a `qtype` GGUF, converted with its
    weights (`full/`, what `_checkpoint` reads) and without (`in-file/`: read from the GGUF
    at load), each marked with its source as the resolver marks a cache entry; returns the
    `checkpoint` one."""
    from engine.gguf_convert import convert
    from engine.model_resolver import CONVERSION_MARKER
    from tests.engine.gguf_writer import write_gguf
    from tests.engine.tiny_models import save_random_config

    config.vocab_size = VOCAB
    save_random_config(config, directory / "hf")
    path = write_gguf(directory / "hf", directory / f"{qtype}.gguf", qtype=qtype)
    for form in ("full", "in-file"):
        convert(path, directory / form, weights=form == "full")
        (directory / form / CONVERSION_MARKER).write_text(json.dumps({"source": str(path)}))
    return directory / checkpoint


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _converted(tmp_path_factory.mktemp("deferred"), _llama_256(), "Q4_K_M").parent


@pytest.fixture(params=["full", "in-file"])
def converted(both: Path, request: pytest.FixtureRequest) -> Path:
    """Deferred from a converted directory's safetensors, and from the GGUF file itself."""
    return both / request.param


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory.parent / "full" / "model.safetensors"))


def test_load_leaves_linear_weights_unread_but_their_sample_rows(converted: Path) -> None:
    model, _ = load_model(str(converted), torch.float32, torch.device("cpu"), defer_linears=True)
    weights = _checkpoint(converted)
    deferred = model.deferred_weights
    linear_tensors = [n for n in weights if "_proj." in n]
    assert len(linear_tensors) == 14  # q k v o gate up down x 2 layers
    assert len(deferred) == 15  # and the token table (the tied head's too)
    table = model.model.embed_tokens.weight
    want_table = weights["model.embed_tokens.weight"]
    rows = sample_rows(table.shape[0])
    assert torch.equal(table[rows], want_table[rows])
    assert deferred.fill(table) == 1 and torch.equal(table, want_table)  # it was pending
    qkv = model.model.layers[1].self_attn.qkv_proj
    parts = [weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    start = 0
    for part in parts:
        rows = sample_rows(part.shape[0])
        assert torch.equal(qkv.weight[start : start + part.shape[0]][rows], part[rows])
        start += part.shape[0]
    assert deferred.fill(qkv.weight) == 3 and deferred.fill(qkv.weight) == 0
    assert torch.equal(qkv.weight, torch.cat(parts))
    assert len(deferred) == 11


def test_a_deferred_engine_packs_and_computes_what_a_full_load_does(
    converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools.quality import _window_logits

    config = EngineConfig(model=str(converted), quantization="gguf", max_model_len=64, block_size=4)
    deferred = EngineCore(config)
    assert not hasattr(deferred.model, "deferred_weights")
    monkeypatch.setattr("engine.core.defer_gguf_linears", lambda *a: False)
    full = EngineCore(config)
    pairs = [
        (a, b)
        for a, b in zip(deferred.model.modules(), full.model.modules(), strict=True)
        if isinstance(a, Linear)
    ]
    assert pairs and all(a.packed is not None for a, _ in pairs)
    for a, b in pairs:
        assert a.weight.numel() == 0 or a.weight is deferred.model.model.embed_tokens.weight
        assert torch.equal(a.packed.data, b.packed.data)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    assert torch.equal(_window_logits(deferred, ids), _window_logits(full, ids))


@pytest.mark.parametrize("checkpoint", ["full", "in-file"])
def test_what_is_not_packed_is_read_in_full(checkpoint: str, tmp_path: Path) -> None:
    """head_dim 16 is not the C attention kernel's: `auto` falls back to the exact mode
    after the load deferred the linears and the table, so every one is read from the
    checkpoint."""
    from transformers import Qwen3Config

    from tests.engine.tiny_models import COMMON

    converted = _converted(tmp_path, Qwen3Config(**COMMON, head_dim=16), "Q8_0", checkpoint)
    core = EngineCore(EngineConfig(model=str(converted), max_model_len=64, block_size=4))
    assert core.backends.quantization == "none"
    weights = _checkpoint(converted)
    layer = core.model.model.layers[0]
    assert torch.equal(layer.mlp.down_proj.weight, weights["model.layers.0.mlp.down_proj.weight"])
    qkv = torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    table = core.model.model.embed_tokens.weight
    assert torch.equal(table, weights["model.embed_tokens.weight"])  # left unread, then read
    linears = [m for m in core.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is None and m.weight.numel() for m in linears)


def test_a_method_that_packs_from_the_dense_weight_reads_it_first(converted: Path) -> None:
    """`gguf-bf16` rounds the dense weight into its tiles (`reads_dense`): each deferred
    weight is read in full just before its layer is packed, and freed after."""
    from engine.backends import _use_gguf_blocks
    from engine.layers.gguf_linear import GGUFBlockLinearMethod, GGUFSource
    from engine.model_resolver import gguf_source

    seen: dict[int, torch.Tensor] = {}

    class DenseReading(GGUFBlockLinearMethod):
        reads_dense = True

        def _pack(self, layer: Linear, rows):
            seen[id(layer)] = layer.weight.detach().clone()
            return super()._pack(layer, rows)

    model, _ = load_model(str(converted), torch.float32, torch.device("cpu"), defer_linears=True)
    kinds = _use_gguf_blocks(model, DenseReading(GGUFSource(gguf_source(str(converted)))))
    assert sum(kinds.values()) == 9  # qkv, o, gate_up, down x 2 layers and the tied head
    weights = _checkpoint(converted)
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(seen[id(down)], weights["model.layers.0.mlp.down_proj.weight"])
    assert down.weight.numel() == 0 and len(model.deferred_weights) == 0


def test_a_moe_layers_stacked_experts_are_freed_before_the_next_layer_packs(
    tmp_path: Path,
) -> None:
    """A method that packs from the dense weight fills each deferred expert weight into its
    layer's stacked `w13` / `w2` first; the stack is freed as soon as that layer's experts
    are packed, so loading holds one layer's float32 experts at a time (a 30 B MoE's are
    ~115 GB in all). The packed experts are the file's: each filled weight is the
    checkpoint's."""
    from transformers import Qwen3MoeConfig

    from engine.backends import _use_gguf_blocks
    from engine.layers.gguf_linear import GGUFBlockLinearMethod, GGUFSource
    from engine.layers.moe import FusedMoE
    from engine.model_resolver import gguf_source
    from tests.engine.tiny_models import COMMON

    config = Qwen3MoeConfig(
        **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
    )
    converted = _converted(tmp_path, config, "Q8_0")
    model, _ = load_model(str(converted), torch.float32, torch.device("cpu"), defer_linears=True)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    owner = {id(linear): i for i, m in enumerate(layers) for linear in (*m.gate_up, *m.down)}
    stacks_held: list[tuple[int, list[bool]]] = []
    filled: dict[int, torch.Tensor] = {}

    class DenseReading(GGUFBlockLinearMethod):
        reads_dense = True

        def _pack(self, layer: Linear, rows):
            if id(layer) in owner:
                stacks_held.append((owner[id(layer)], [m.w13.numel() > 0 for m in layers]))
                filled[id(layer)] = layer.weight.detach().clone()
            return super()._pack(layer, rows)

    _use_gguf_blocks(model, DenseReading(GGUFSource(gguf_source(str(converted)))))
    assert {i for i, _ in stacks_held} == {0, 1}
    for i, held in stacks_held:  # packing layer i: every earlier layer's stack is gone
        assert held == [j >= i for j in range(len(layers))], (i, held)
    assert all(m.w13.numel() == 0 and m.w2.numel() == 0 for m in layers)
    weights = _checkpoint(converted)
    expert = layers[1].down[5]
    assert torch.equal(filled[id(expert)], weights["model.layers.1.mlp.experts.5.down_proj.weight"])
    experts = [linear for m in layers for linear in (*m.gate_up, *m.down)]
    assert all(model.deferred_weights.fill(linear.weight) == 0 for linear in experts)
