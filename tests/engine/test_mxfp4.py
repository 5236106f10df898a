"""gpt-oss's released MXFP4 expert weights, dequantized at load (engine/models/mxfp4.py).

A tiny random gpt-oss checkpoint (tests/engine/moe_models.py) has its experts'
``gate_up_proj`` and ``down_proj`` packed to MXFP4 by `pack_mxfp4` below and is saved as
the released checkpoints are: ``*_blocks`` / ``*_scales`` tensors, dense biases, and
``quantization_config`` ``{"quant_method": "mxfp4", ...}`` in config.json. transformers
reads that same directory itself (``Mxfp4Config(dequantize=True)``, on CPU, nothing from
the network): its `convert_moe_packed_tensors` and its `generate` are the oracles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from engine.config import EngineConfig
from engine.layers.moe import FusedMoE
from engine.model_loader import load_model
from engine.models.mxfp4 import dequantize_mxfp4_tensors
from engine.models.registry import get_model_class
from tests.engine.moe_models import CONFIGS, VOCAB, hf_reference, one_thread
from tests.engine.test_greedy_parity import _generate as engine_greedy
from tests.engine.test_llama_parity import _prompts
from tests.gpu.gpu_models import write_tokenizer

NEW_TOKENS = 12
PROMPTS = _prompts(4, [5, 1, 19, 33], vocab=VOCAB, seed=5)
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
}  # fmt: skip
"""As in the released gpt-oss config.json files."""

EXPERT_PROJS = ("gate_up_proj", "down_proj")


def _quiet(_: str) -> None:
    """Progress sink: keep test output clean."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bit patterns (signed zeros and NaNs told apart), for bitwise comparisons."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def pack_mxfp4(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense expert tensor ``[E, in, out]`` as MXFP4 ``(blocks [E, out, in/32, 16],
    scales [E, out, in/32])``, the inverse of transformers' reader: each 32-value run of
    a row gets the smallest power-of-two scale that fits its largest magnitude in 6.0,
    each value the nearest FP4 code; the even element in the low nibble."""
    rows = dense.transpose(1, 2).float()  # [E, out, in]
    runs = rows.reshape(*rows.shape[:2], -1, 32)  # [E, out, G, 32]
    exponent = torch.ceil(torch.log2(runs.abs().amax(-1) / 6.0)).clamp(-127, 127)
    scaled = runs / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [E, out, G, 16]
    return blocks, (exponent + 127).to(torch.uint8)


@dataclass
class Mxfp4Checkpoint:
    dir: Path
    packed: dict[str, torch.Tensor]
    """The checkpoint's tensors as saved."""
    hf: torch.nn.Module
    """transformers' model of the directory (dequantized by transformers)."""


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Mxfp4Checkpoint:
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf_reference("gpt-oss").save_pretrained(directory)
    write_tokenizer(directory, VOCAB)
    weights = directory / "model.safetensors"
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(weights).items():
        if name.endswith(tuple(f".experts.{p}" for p in EXPERT_PROJS)):
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = pack_mxfp4(tensor)
        else:
            packed[name] = tensor
    save_file(packed, weights, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(
        json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG})
    )
    hf = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    return Mxfp4Checkpoint(directory, packed, hf.eval())


def _stacked(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense checkpoint-layout experts as hearth stacks them: w13 ``[E, 2I, H]`` (gate
    rows, then up rows), w2 ``[E, H, I]``."""
    w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
    return w13, down.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """Every byte value under scales from 2**-127 to 2**127, both nibbles: the dense
    tensor's bits are `convert_moe_packed_tensors`' (signed zeros, infinities and
    subnormals included); the halves pair up in either order, other tensors pass."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=gen)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 2), dtype=torch.uint8, generator=gen)
    scales.view(-1)[:2] = torch.tensor([0, 254], dtype=torch.uint8)
    bias = torch.randn(3, 40)
    stream = [
        ("e.down_proj_scales", scales),
        ("e.down_proj_bias", bias),
        ("e.down_proj_blocks", blocks),
    ]
    out = list(dequantize_mxfp4_tensors(stream, dtype, torch.device("cpu")))
    assert [name for name, _ in out] == ["e.down_proj_bias", "e.down_proj"]
    assert out[0][1] is bias
    got, want = out[1][1], convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape == (3, 64, 40)
    assert torch.equal(bits(got), bits(want))
    assert torch.isinf(want).any() and (bits(want) == bits(torch.tensor(-0.0, dtype=dtype))).any()


def test_unpaired_or_misshapen_halves_are_refused() -> None:
    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    scales = torch.zeros(2, 4, 1, dtype=torch.uint8)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"x\.gate_up_proj_blocks has no x\.gate_up_proj_scales"):
        list(dequantize_mxfp4_tensors([("x.gate_up_proj_blocks", blocks)], torch.float32, cpu))
    with pytest.raises(ValueError, match=r"x\.down_proj_scales has no x\.down_proj_blocks"):
        list(dequantize_mxfp4_tensors([("x.down_proj_scales", scales)], torch.float32, cpu))
    bad = [("x.down_proj_blocks", blocks), ("x.down_proj_scales", scales[:, :3])]
    with pytest.raises(ValueError, match=r"x\.down_proj: MXFP4 blocks .* do not match scales"):
        list(dequantize_mxfp4_tensors(bad, torch.float32, cpu))
    wrong_dtype = [("x.down_proj_blocks", blocks.float()), ("x.down_proj_scales", scales)]
    with pytest.raises(ValueError, match="must be uint8"):
        list(dequantize_mxfp4_tensors(wrong_dtype, torch.float32, cpu))


def test_other_quantization_methods_are_refused() -> None:
    config = CONFIGS["gpt-oss"]()
    config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="gpt-oss quantization 'bitsandbytes' is not supported"):
        get_model_class(config)(config, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_loaded_experts_are_transformers_dequantized(
    mxfp4: Mxfp4Checkpoint, dtype: torch.dtype
) -> None:
    """hearth's stacked expert weights from the MXFP4 directory, in the model dtype, are
    bitwise `convert_moe_packed_tensors` of the saved blocks (in float32 also the
    weights transformers' own model loaded); the packer is the layout's inverse."""
    model, _ = load_model(str(mxfp4.dir), dtype, torch.device("cpu"), progress=_quiet)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == len(mxfp4.hf.model.layers)
    for i, moe in enumerate(moes):
        base = f"model.layers.{i}.mlp.experts"
        dense = {
            p: convert_moe_packed_tensors(
                mxfp4.packed[f"{base}.{p}_blocks"], mxfp4.packed[f"{base}.{p}_scales"], dtype=dtype
            )
            for p in EXPERT_PROJS
        }  # fmt: skip
        w13, w2 = _stacked(dense["gate_up_proj"], dense["down_proj"])
        assert moe.w13.dtype == moe.w2.dtype == dtype
        assert torch.equal(bits(moe.w13), bits(w13)) and torch.equal(bits(moe.w2), bits(w2))
        if dtype == torch.float32:
            hf_experts = mxfp4.hf.model.layers[i].mlp.experts
            for p in EXPERT_PROJS:
                assert torch.equal(bits(getattr(hf_experts, p).data), bits(dense[p]))
                repacked = pack_mxfp4(dense[p])
                assert torch.equal(convert_moe_packed_tensors(*repacked, dtype=dtype), dense[p])


def test_greedy_output_matches_transformers_generate(mxfp4: Mxfp4Checkpoint) -> None:
    """The whole engine on the MXFP4 directory (float32), the prompts batched: the
    tokens transformers' `generate` gives on the same directory, each prompt alone."""
    from engine.core import EngineCore

    want = []
    with torch.no_grad(), one_thread():
        for prompt in PROMPTS:
            out = mxfp4.hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            )  # fmt: skip
            want.append(out[0, len(prompt) :].tolist())
    core = EngineCore(EngineConfig(model=str(mxfp4.dir), dtype="float32", max_model_len=128))
    got = engine_greedy(core, PROMPTS, "mx", at_once=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_dequantizes_on_the_device_as_on_cpu(
    mxfp4: Mxfp4Checkpoint, dtype: torch.dtype
) -> None:
    """Loaded onto CUDA, the blocks are dequantized there: the same bits as on CPU."""
    on_cpu, _ = load_model(str(mxfp4.dir), dtype, torch.device("cpu"), progress=_quiet)
    on_cuda, _ = load_model(str(mxfp4.dir), dtype, torch.device("cuda"), progress=_quiet)
    pairs = zip(
        (m for m in on_cpu.modules() if isinstance(m, FusedMoE)),
        (m for m in on_cuda.modules() if isinstance(m, FusedMoE)),
        strict=True,
    )
    for cpu, cuda in pairs:
        assert cuda.w13.is_cuda and cuda.w13.dtype == dtype
        assert torch.equal(bits(cuda.w13.cpu()), bits(cpu.w13))
        assert torch.equal(bits(cuda.w2.cpu()), bits(cpu.w2))
