"""GGUF files of each architecture hearth converts: written from a tiny transformers
checkpoint as llama.cpp would (tests/engine/gguf_writer.py), converted by
`engine.gguf_convert`, served by the engine in float32: greedy output token-identical to
transformers on the original checkpoint.

Each config sets what transformers' GGUF loader alone gets wrong for its architecture
(engine/gguf_arch.py): Llama's and Qwen3's biases, Qwen3's head_dim that is not 128, Qwen3-MoE's
expert width, Gemma 3's query scale, soft-capping and scaled global rope, Phi-3's partial
rotary, window and LongRoPE factors, Mixtral's experts (a "llama" file, which transformers
reads as a dense Llama). Files that would convert to another model (SmolLM3) are refused with
the reason and the list of what is served.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    Gemma3TextConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.gguf_convert import convert
from engine.model_resolver import CONVERSION_MARKER, ModelConversionError, resolve_model_dir
from tests.engine.gguf_writer import write_gguf
from tests.engine.test_greedy_parity import _generate, assert_agrees_with_reference
from tests.engine.tiny_models import (
    COMMON,
    llama3_rope,
    llama_untied_bias,
    phi3_longrope,
    phi3_partial_sliding,
    qwen2,
    save_random_config,
)

VOCAB = 320
"""Room for the writer's byte-level vocabulary (256 bytes, merges, an end token)."""
NEW_TOKENS = 10
PROMPT_LENS = [5, 19, 33]


def _qwen3moe(**fields: Any) -> PretrainedConfig:
    """A tiny Qwen3-MoE: four experts of width 32, two a token; `fields` override."""
    return Qwen3MoeConfig(
        **{
            **COMMON,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "tie_word_embeddings": True,
            **fields,
        }
    )


def _mixtral(**fields: Any) -> PretrainedConfig:
    """A tiny Mixtral (llama.cpp writes it as "llama" with stacked experts): four experts
    of width 32, two a token; `fields` override."""
    return MixtralConfig(
        **{
            **COMMON,
            "head_dim": 16,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            **fields,
        }
    )


def _gemma3() -> PretrainedConfig:
    # Six layers: llama.cpp fixes Gemma 3's pattern (five sliding, one global) and its
    # query scale (1/sqrt(head_dim)); a GGUF cannot say otherwise.
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    }
    return Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=6, final_logit_softcapping=30.0, rope_parameters=rope,
    )  # fmt: skip


CASES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-untied-bias-headdim": llama_untied_bias,
    "llama3-rope": llama3_rope,  # read back from the `rope_freqs` tensor
    "qwen2-qkv-bias": qwen2,
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    "qwen3-linear-rope": lambda: Qwen3Config(
        **COMMON,
        head_dim=16,
        rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 5e4},
    ),
    "qwen3-bias-untied": lambda: Qwen3Config(
        **COMMON, head_dim=16, attention_bias=True, tie_word_embeddings=False
    ),
    "qwen3moe": _qwen3moe,
    "mixtral": _mixtral,
    "gemma3": _gemma3,
    "phi3-partial-sliding": phi3_partial_sliding,
    "phi3-longrope": phi3_longrope,
}


def _save(config: PretrainedConfig, directory: Path) -> torch.nn.Module:
    config.vocab_size = VOCAB
    return save_random_config(config, directory)


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_converted_gguf_is_token_identical_to_transformers(name: str, tmp_path: Path) -> None:
    hf = _save(CASES[name](), tmp_path / "hf")
    gguf_path = write_gguf(tmp_path / "hf", tmp_path / f"{name}.gguf")
    _convert_marked(gguf_path, tmp_path / "converted")  # the weights stay in the file
    core = EngineCore(
        EngineConfig(
            model=str(tmp_path / "converted"), dtype="float32", max_model_len=64, block_size=4
        )
    )
    assert core.model_info.architecture == type(hf).__name__
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    got = _generate(core, prompts, "g", at_once=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert got == [_hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("name", [n for n in CASES if n != "mixtral"])
def test_streaming_conversion_writes_what_transformers_loader_does(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files convert tensor by tensor (never the whole model in memory): the same
    checkpoint names, float32 values bit for bit and config as transformers' whole-model
    loader gives (a MoE's stacked experts as the per-expert matrices its saved checkpoint
    holds); a small shard size splits them into an indexed, sharded checkpoint. Left
    in the file (`engine.gguf_checkpoint`), the tensors read at load are the same, and so
    are the rows of those left in their blocks and each one read whole afterwards."""
    from safetensors.torch import load_file

    import engine.gguf_convert as gguf_convert
    from engine.gguf_checkpoint import GGUFCheckpoint, GGUFRows

    _save(CASES[name](), tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / f"{name}.gguf", qtype="Q8_0")
    convert(path, tmp_path / "whole", whole=True)
    convert(path, tmp_path / "stream")
    want = load_file(str(tmp_path / "whole" / "model.safetensors"))
    got = load_file(str(tmp_path / "stream" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], tensor), key
    config = lambda d: {  # noqa: E731
        k: v
        for k, v in json.loads((d / "config.json").read_text()).items()
        if k != "transformers_version"
    }
    assert config(tmp_path / "stream") == config(tmp_path / "whole")

    _convert_marked(path, tmp_path / "in-file")
    assert not list((tmp_path / "in-file").glob("*.safetensors"))
    assert config(tmp_path / "in-file") == config(tmp_path / "whole")
    read = dict(GGUFCheckpoint.of_directory(tmp_path / "in-file").tensors())
    assert sorted(read) == sorted(want)
    assert all(read[k].dtype == torch.float32 and torch.equal(read[k], want[k]) for k in want)
    matrices = {k for k, t in want.items() if t.dim() == 2}
    checkpoint = GGUFCheckpoint.of_directory(tmp_path / "in-file")
    left = dict(checkpoint.tensors(matrices))
    assert sorted(left) == sorted(want)
    for key in matrices:
        rows = [0, 1, left[key].shape[0] // 2, left[key].shape[0] - 1]
        assert isinstance(left[key], GGUFRows) and left[key].shape == want[key].shape
        assert torch.equal(left[key][rows], want[key][rows]), key
        assert torch.equal(checkpoint.read(key), want[key]), key

    smallest = min(t.numel() * 4 for t in want.values() if t.dim() == 2)
    monkeypatch.setattr(gguf_convert, "_SHARD_BYTES", smallest)
    convert(path, tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    sharded = {}
    for file in files:
        sharded.update(load_file(str(tmp_path / "sharded" / file)))
    assert sorted(sharded) == sorted(want) and all(torch.equal(sharded[k], want[k]) for k in want)
    assert not list((tmp_path / "sharded").glob("*.tmp"))


def test_a_mixtral_gguf_converts_to_its_checkpoints_names_and_values(tmp_path: Path) -> None:
    """A Mixtral file ("llama" with stacked experts; transformers' loader reads it as a dense
    Llama, so there is no whole-model reference): streamed and left in the file, every
    tensor is the saved checkpoint's, under its names (`block_sparse_moe.gate`, each
    expert's `w1` / `w3` / `w2`), bit for bit (F32 file); the config is a Mixtral's."""
    from safetensors.torch import load_file

    from engine.gguf_checkpoint import GGUFCheckpoint

    _save(_mixtral(), tmp_path / "hf")
    want = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in want
    path = write_gguf(tmp_path / "hf", tmp_path / "mixtral.gguf")
    convert(path, tmp_path / "stream")
    got = load_file(str(tmp_path / "stream" / "model.safetensors"))
    _convert_marked(path, tmp_path / "in-file")
    read = dict(GGUFCheckpoint.of_directory(tmp_path / "in-file").tensors())
    tied = {"lm_head.weight"} if "lm_head.weight" not in got else set()
    for tensors in (got, read):
        assert sorted(tensors) == sorted(set(want) - tied)
        for key, tensor in tensors.items():
            assert torch.equal(tensor, want[key]), key
    config = json.loads((tmp_path / "in-file" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)


def test_a_mixtral_gguf_of_per_expert_tensors_is_refused() -> None:
    """llama.cpp wrote each expert as its own tensor before 2024 (`blk.0.ffn_gate.3.weight`):
    no layout hearth reads; the refusal says to convert again."""
    from engine.gguf_arch import _mixtral_config

    names = {"blk.0.ffn_gate.0.weight", "blk.0.ffn_gate_inp.weight"}
    with pytest.raises(ValueError, match=r"not stacked per projection.*before 2024"):
        _mixtral_config({}, {"llama.expert_count": 8}, names)


@pytest.mark.parametrize("weights", [True, False])
def test_a_tensor_of_the_wrong_shape_is_refused_while_streaming(
    weights: bool, tmp_path: Path
) -> None:
    """A file whose vocabulary disagrees with its token table is refused with both shapes
    named, where transformers' loader failed with a size-mismatch report."""
    import gguf

    from engine.gguf_convert import ConversionRefused
    from tools.requantize_gguf import copy_metadata

    _save(CASES["qwen3"](), tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "good.gguf")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen3")
    copy_metadata(reader, writer)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "token_embd.weight":
            data = data[:-8]  # 8 rows short of the vocabulary
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionRefused, match=r"token_embd\.weight is \[312, 64\].*\[320, 64\]"):
        convert(tmp_path / "bad.gguf", tmp_path / "out", weights=weights)


def test_quantized_gguf_converts_to_its_dequantized_weights(tmp_path: Path) -> None:
    """Q8_0 and Q4_1 blocks come out as gguf-py dequantizes them, in the HF row order."""
    import gguf
    from safetensors.torch import load_file

    _save(CASES["qwen3"](), tmp_path / "hf")
    for qtype in ("Q8_0", "Q4_1"):
        path = write_gguf(tmp_path / "hf", tmp_path / f"{qtype}.gguf", qtype=qtype)
        convert(path, tmp_path / qtype)
        weights = load_file(str(tmp_path / qtype / "model.safetensors"))
        reader = gguf.GGUFReader(str(path))
        tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
        assert tensor.tensor_type == getattr(gguf.GGMLQuantizationType, qtype)
        expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type))
        assert torch.equal(weights["model.layers.1.self_attn.k_proj.weight"], expected)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (
            lambda: SmolLM3Config(**COMMON),
            r"GGUF architecture 'smollm3' is not converted \(transformers' GGUF loader has no",
        ),
    ],
    ids=["smollm3"],
)
def test_unconverted_architectures_are_refused_naming_the_served_ones(
    config: Callable[[], PretrainedConfig], reason: str, tmp_path: Path
) -> None:
    _save(config(), tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    with pytest.raises(ModelConversionError) as info:
        resolve_model_dir(str(path), str(tmp_path / "cache"), lambda _: None)
    message = str(info.value)
    assert message.startswith(f"cannot serve {path}: ")
    assert re.search(reason, message), message
    assert (
        "GGUF architectures served: gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3moe" in message
    )


FAST_CASES: dict[str, Callable[[], PretrainedConfig]] = {
    # head_dim 32: the C attention kernel's unit
    "qwen3": lambda: Qwen3Config(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
        head_dim=32,
        tie_word_embeddings=True,
    ),
    "qwen2": lambda: Qwen2Config(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}, tie_word_embeddings=False
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 6},
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=6,
        final_logit_softcapping=30.0,
    ),
    "phi3": lambda: Phi3Config(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
        partial_rotary_factor=0.5,
        sliding_window=8,
    ),
    # eight experts: the router's eight rows are a kernel group, so it computes from the
    # file too; each expert's matrices are slices of the layer's stacked tensors
    "qwen3moe": lambda: _qwen3moe(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8
    ),
    "mixtral": lambda: _mixtral(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=8
    ),
}


def _convert_marked(path: Path, out: Path, weights: bool = False) -> None:
    """`convert` in-process as `hearth serve` converts (the weights left in the file unless
    `weights`), marked with its source as `resolve_model_dir` marks a cache entry (the
    engine finds the file through the marker); the resolver's own child, which costs a
    fresh torch import, is tested in tests/engine/test_model_loader.py."""
    convert(path, out, weights=weights)
    (out / CONVERSION_MARKER).write_text(json.dumps({"source": str(path)}))


@pytest.mark.parametrize("name", list(FAST_CASES))
def test_q8_0_gguf_runs_the_cpu_fast_path(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--quantization gguf` on a Q8_0 file of a new architecture: every linear (Phi-3's
    fused qkv and gate_up, each of Qwen3-MoE's experts and its router too) computes from
    the file's blocks, which are the exact mode's weights, none of them read whole at load
    (a MoE layer's experts in one C call),
    and greedy output agrees with the exact mode (only the order of float32 sums differs:
    `assert_agrees_with_reference`'s bound)."""
    from engine.gguf_checkpoint import GGUFCheckpoint
    from engine.layers.gguf_linear import GGUFBlockLinearMethod
    from engine.layers.linear import Linear
    from engine.layers.moe import PACKED_EXPERTS, FusedMoE
    from kernels.cpu import ops

    if not ops.available():
        pytest.skip("host has no AVX2: the fast path does not run here")
    _save(FAST_CASES[name](), tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / f"{name}.gguf", qtype="Q8_0")
    _convert_marked(path, tmp_path / "converted")
    config = {"model": str(tmp_path / "converted"), "max_model_len": 64, "block_size": 4}
    read_whole: list[str] = []
    real_read = GGUFCheckpoint.read
    monkeypatch.setattr(
        GGUFCheckpoint, "read", lambda self, n: read_whole.append(n) or real_read(self, n)
    )
    fast = EngineCore(EngineConfig(**config, quantization="gguf"))  # type: ignore[arg-type]
    assert read_whole == []
    exact = EngineCore(EngineConfig(**config, dtype="float32"))  # type: ignore[arg-type]
    assert fast.backends.quantization == "gguf" and exact.backends.quantization == "none"
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, GGUFBlockLinearMethod) for m in linears)
    assert f"{len(linears)} q8_0" in fast.backends.description
    moe = [m for m in fast.model.modules() if isinstance(m, FusedMoE)]
    assert bool(moe) == (name in ("qwen3moe", "mixtral"))
    assert all(m.method is PACKED_EXPERTS for m in moe)
    if moe:  # the whole expert layer in one C call
        assert f"{len(moe)} MoE layers' experts in one C call each" in fast.backends.description
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    want = _generate(exact, prompts, "e", at_once=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = _generate(fast, prompts, "f", at_once=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert_agrees_with_reference(got, want)


@pytest.mark.parametrize(
    ("arch", "scaling"), [("qwen3", "yarn"), ("llama", "longrope"), ("phi3", "linear")]
)
def test_rope_scaling_the_loader_drops_is_refused(arch: str, scaling: str) -> None:
    from engine.gguf_arch import refusal

    why = refusal(arch, {f"{arch}.rope.scaling.type": scaling})
    assert why is not None and f"uses {scaling!r} rope scaling" in why
    assert refusal(arch, {f"{arch}.rope.scaling.type": "none"}) is None


def test_an_architecture_without_a_conversion_is_refused_naming_the_served_ones() -> None:
    from engine.gguf_arch import refusal

    why = refusal("gpt-oss", {"general.architecture": "gpt-oss"})
    assert why is not None and why.startswith("GGUF architecture 'gpt-oss' is not converted")
    assert "served: gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3moe" in why


@pytest.mark.parametrize(
    ("factor", "theta", "dim"), [(8.0, 500000.0, 128), (32.0, 500000.0, 64), (8.0, 10000.0, 16)]
)
def test_llama3_rope_scaling_is_read_back_from_the_rope_freqs_tensor(
    factor: float, theta: float, dim: int
) -> None:
    """Llama 3.1 (factor 8) and 3.2 (factor 32) as Meta ships them: the parameters that
    llama.cpp's divisors came from, found again; divisors no llama3 scaling gives are
    refused with the reason."""
    from types import SimpleNamespace

    from engine.gguf_arch import llama3_rope
    from tests.engine.gguf_writer import _llama3_rope_freqs

    rope = {
        "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    freqs = _llama3_rope_freqs({"head_dim": dim}, rope)
    reader = SimpleNamespace(tensors=[SimpleNamespace(name="rope_freqs.weight", data=freqs)])
    assert llama3_rope(reader, theta, dim) == rope
    assert llama3_rope(SimpleNamespace(tensors=[]), theta, dim) is None
    bent = freqs.copy()
    bent[len(bent) // 2] *= 1.01
    with pytest.raises(ValueError, match="no llama3 rope scaling"):
        llama3_rope(
            SimpleNamespace(tensors=[SimpleNamespace(name="rope_freqs.weight", data=bent)]),
            theta,
            dim,
        )
