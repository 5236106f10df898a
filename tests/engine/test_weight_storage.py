"""A bf16 / f16 checkpoint bound for the 16-bit kernels is loaded in its own type.

The contract (engine/layers/weight_storage.py, engine/backends.py `linear_storage_dtype`):
where the fast path will pack a safetensors model's linears in 16 bits, the loader holds
them in the checkpoint's type, bit for bit, so start-up needs 2 bytes a weight instead of 4;
the packed weights are the same bytes as when the loader widened them to float32; whatever
ends up dense (the exact fallback, a layer the kernels can't take) is widened back exactly
and computes what the float32-loaded model computes. Every other run loads as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.backends import auto_gguf_mode, choose_backends, linear_storage_dtype
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.layers.linear import Linear
from engine.layers.moe import FusedMoE
from engine.messages import AddRequest
from engine.model_loader import checkpoint_dtype, load_model
from engine.sampling_params import SamplingParams
from tests.engine.engine_runs import blocks_core, greedy_runs
from tests.engine.test_half_weights import (
    VOCAB,
    _llama,
    _prompts,
    _qwen3_untied,
    _save_in,
    save_random_config,
)
from tests.engine.tiny_models import llama_tied

ops = pytest.importorskip("kernels.cpu.ops")
needs_avx2 = pytest.mark.skipif(
    not ops.available(), reason="host has no AVX2: the C kernels do not run here"
)
CPU = torch.device("cpu")


def _config(model_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_model_len=64, **overrides)


def _dense_16_bit(model: torch.nn.Module) -> list[str]:
    """Names of linear weights still held dense in a 16-bit type, and MoE stacks."""
    held = [
        name
        for name, m in model.named_modules()
        if isinstance(m, Linear)
        and m.packed is None
        and m.weight.numel()
        and m.weight.dtype != torch.float32
    ]
    return held + [
        name
        for name, m in model.named_modules()
        if isinstance(m, FusedMoE) and m.w13.numel() and m.w13.dtype != torch.float32
    ]


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_a_16_bit_checkpoint_loads_its_linears_bit_for_bit_in_its_own_type(
    dtype: torch.dtype, name: str, tmp_path: Path
) -> None:
    """Linears and the embedding table hold the checkpoint's tensors in its type (fused
    q/k/v rows each their own tensor's bits; a tied head still shares the table); the
    norms stay float32."""
    save_random_config(_qwen3_untied(), tmp_path)
    _save_in(tmp_path, dtype, matrices_only=True)
    assert checkpoint_dtype(tmp_path) == name
    assert linear_storage_dtype(_config(tmp_path), str(tmp_path), torch.float32, CPU) == dtype
    model, _ = load_model(str(tmp_path), torch.float32, CPU, lambda _: None, dtype)
    stored = load_file(tmp_path / "model.safetensors")
    linears = dict(model.named_modules())
    q = linears["model.layers.0.self_attn.qkv_proj"].weight
    want = stored["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == dtype and torch.equal(
        q[: want.shape[0]].view(torch.int16), want.view(torch.int16)
    )
    assert linears["lm_head"].weight.dtype == dtype
    assert torch.equal(linears["lm_head"].weight, stored["lm_head.weight"])
    table = model.model.embed_tokens.weight
    assert table.dtype == dtype and torch.equal(table, stored["model.embed_tokens.weight"])
    assert model.model.norm.weight.dtype == torch.float32

    save_random_config(_llama(), tmp_path / "tied")
    _save_in(tmp_path / "tied", dtype, matrices_only=True)
    tied, _ = load_model(str(tmp_path / "tied"), torch.float32, CPU, lambda _: None, dtype)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.dtype == dtype


def test_only_runs_that_pack_16_bit_weights_hold_them(tmp_path: Path) -> None:
    """The exact mode (asked for by --quantization none or --dtype float32), the integer
    modes (which quantize at load from float32), a float32 or mixed checkpoint (a float32
    head, or float32 stacked experts, beside bf16 matrices), a GGUF model and a GPU all
    load as before."""
    from tests.engine.gguf_writer import write_gguf

    save_random_config(_llama(), tmp_path / "bf16")
    _save_in(tmp_path / "bf16", torch.bfloat16)
    bf16 = tmp_path / "bf16"

    def held(model_dir: Path, device: torch.device = CPU, **overrides) -> torch.dtype | None:
        return linear_storage_dtype(
            _config(model_dir, **overrides), str(model_dir), torch.float32, device
        )

    assert held(bf16) == held(bf16, quantization="gguf") == torch.bfloat16
    assert held(bf16, quantization="gguf-bf16") == torch.bfloat16
    assert held(bf16, quantization="none") is None
    assert held(bf16, dtype="float32") is None
    assert held(bf16, quantization="q8_0") is None
    assert held(bf16, quantization="gguf-int8") is None
    assert held(bf16, torch.device("cuda")) is None
    assert linear_storage_dtype(_config(bf16), str(bf16), torch.bfloat16, CPU) is None
    save_random_config(_llama(), tmp_path / "f32")
    assert checkpoint_dtype(tmp_path / "f32") == "F32" and held(tmp_path / "f32") is None
    save_random_config(_llama(), tmp_path / "mixed")
    _save_in(tmp_path / "mixed", torch.bfloat16)
    stored = load_file(tmp_path / "mixed" / "model.safetensors")
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"].float()
    from safetensors.torch import save_file

    save_file(stored, tmp_path / "mixed" / "model.safetensors")
    assert checkpoint_dtype(tmp_path / "mixed") is None and held(tmp_path / "mixed") is None
    del stored["lm_head.weight"]  # bf16 matrices again, beside float32 stacked experts
    stored["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(2, 8, 4)
    save_file(stored, tmp_path / "mixed" / "model.safetensors")
    assert checkpoint_dtype(tmp_path / "mixed") is None
    (tmp_path / "mixed" / "model.safetensors").write_bytes(b"\xff" * 16)  # not safetensors
    assert checkpoint_dtype(tmp_path / "mixed") is None  # load_model names the problem
    assert checkpoint_dtype(tmp_path / "absent") is None
    save_random_config(_llama(), tmp_path / "hf")
    gguf = write_gguf(tmp_path / "hf", tmp_path / "model.gguf", qtype="F16")
    from engine.model_resolver import resolve_model_dir

    converted = Path(resolve_model_dir(str(gguf), str(tmp_path / "cache")))
    assert held(converted) is None


@needs_avx2
def test_held_weights_pack_the_bytes_the_widened_ones_did(tmp_path: Path) -> None:
    """The engine (holding bf16) and a load in float32 handed to the same backend choice
    pack identical bytes, and no dense 16-bit weight is left behind."""
    save_random_config(_qwen3_untied(), tmp_path)
    _save_in(tmp_path, torch.bfloat16)
    said: list[str] = []
    core = EngineCore(_config(tmp_path), progress=said.append)
    assert any(", 10 weights in bfloat16, " in line for line in said), said
    wide, _ = load_model(str(tmp_path), torch.float32, CPU, lambda _: None)
    choose_backends(wide, _config(tmp_path), str(tmp_path), torch.float32, CPU, lambda _: None)
    pairs = zip(
        [m for m in core.model.modules() if isinstance(m, Linear)],
        [m for m in wide.modules() if isinstance(m, Linear)],
        strict=True,
    )
    for mine, theirs in pairs:
        assert mine.packed is not None and torch.equal(mine.packed.data, theirs.packed.data)
    assert _dense_16_bit(core.model) == []
    assert core.model.model.embed_tokens.weight.dtype == torch.bfloat16  # the C gather's


def _tiny_moe(tmp_path: Path, head_dim: int, name: str = "mixtral") -> Path:
    from tests.engine.moe_models import CONFIGS

    config = CONFIGS[name]()
    config.head_dim, config.vocab_size = head_dim, VOCAB
    save_random_config(config, tmp_path)
    _save_in(tmp_path, torch.bfloat16)
    return tmp_path


@pytest.mark.parametrize("model", ["llama", "mixtral", "gpt-oss"])
def test_a_dense_fallback_widens_held_weights_and_computes_the_float32_load(
    model: str, tmp_path: Path
) -> None:
    """Heads of 16 (the C attention takes multiples of 32), or gpt-oss's attention sinks
    (which it has no term for): `auto` falls back to the exact mode after loading bf16
    weights; every weight (MoE expert stacks and the expert linears viewing them, the
    embedding table and a head tied to it included) is float32 again, and greedy tokens
    and logprobs are those of the run that loaded float32 from the start."""
    if model == "llama":
        config = llama_tied()
        config.vocab_size = VOCAB
        save_random_config(config, tmp_path)
        _save_in(tmp_path, torch.bfloat16)
    else:
        _tiny_moe(tmp_path, head_dim=32 if model == "gpt-oss" else 16, name=model)
    assert linear_storage_dtype(_config(tmp_path), str(tmp_path), torch.float32, CPU)
    fallback = EngineCore(_config(tmp_path))
    exact = EngineCore(_config(tmp_path, dtype="float32"))
    assert fallback.backends.quantization == exact.backends.quantization == "none"
    assert _dense_16_bit(fallback.model) == []
    table = fallback.model.model.embed_tokens.weight
    assert table.dtype == torch.float32  # the torch gather reads float32 alone
    if model == "llama":
        assert fallback.model.lm_head.weight is table  # still tied
    for moe in (m for m in fallback.model.modules() if isinstance(m, FusedMoE)):
        assert moe.gate_up[1].weight.data_ptr() == moe.w13[1].data_ptr()
        assert moe.down[2].weight.data_ptr() == moe.w2[2].data_ptr()
    prompts = _prompts()
    assert greedy_runs(fallback, prompts, 6) == greedy_runs(exact, prompts, 6)


@needs_avx2
def test_layers_the_kernels_cant_take_are_widened_beside_packed_ones(tmp_path: Path) -> None:
    """Mixtral's 4-expert routers are not whole 8-row groups: they stay dense (float32
    again) while every expert is packed from the held bf16 rows and the stacks dropped."""
    _tiny_moe(tmp_path, head_dim=32)
    core = EngineCore(_config(tmp_path, kv_cache_dtype="float32"))
    assert core.backends.quantization == auto_gguf_mode()
    dense = [m for m in core.model.modules() if isinstance(m, Linear) and m.packed is None]
    assert dense and all(m.weight.dtype == torch.float32 for m in dense)
    assert _dense_16_bit(core.model) == []
    assert all(m.w13.numel() == 0 for m in core.model.modules() if isinstance(m, FusedMoE))


@needs_avx2
def test_a_lora_adapter_over_held_weights_computes_the_exact_modes_tokens(tmp_path: Path) -> None:
    """An adapter on every projection of a bf16 model served from its held weights: the
    C LoRA term over the packed base (float32 activations, `gguf`) gives the greedy tokens
    of the exact mode (base widened to float32, the adapter in torch, PEFT's order)."""
    from tests.lora_adapters import write_random_adapter

    save_random_config(_llama(), tmp_path / "base")
    _save_in(tmp_path / "base", torch.bfloat16)
    adapter = write_random_adapter(str(tmp_path / "base"), tmp_path / "tuned", seed=2, b_scale=0.05)

    def core(**overrides) -> EngineCore:
        return EngineCore(
            _config(
                tmp_path / "base", enable_lora=True, lora_modules=(("tuned", adapter),),
                max_lora_rank=16, **overrides,
            )
        )  # fmt: skip

    fast, exact = blocks_core(core, kv_cache_dtype="float32"), core(dtype="float32")
    assert fast.backends.quantization == "gguf" and exact.backends.quantization == "none"
    tokens = {}
    for name, engine in (("fast", fast), ("exact", exact)):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, ids in enumerate(_prompts()):
            for lora in (None, "tuned"):
                engine.add_request(
                    AddRequest(request_id=f"{lora}-{i}", prompt_token_ids=ids, params=params,
                               lora_name=lora)
                )  # fmt: skip
        got: dict[str, list[int]] = {}
        while engine.has_work():
            for _, out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        tokens[name] = got
    assert tokens["fast"] == tokens["exact"]
    assert any(tokens["fast"][f"tuned-{i}"] != tokens["fast"][f"None-{i}"] for i in range(3))
