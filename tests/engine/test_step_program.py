"""The CPU step program: the model's own forward recorded once and replayed by one C call
per step must give bitwise what the eager op-by-op forward gives, for decodes, prefill
chunks and mixed steps of any token count, and must refuse to capture a forward that
computes anything outside the C kernels."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig

pytestmark = [pytest.mark.slow]
ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the fast path does not run here", allow_module_level=True)


@pytest.fixture(scope="module", params=["gguf", "gguf-bf16", "gguf-int8"])
def core(request, model_smollm2_dir: str):
    from engine.core import EngineCore
    from kernels.cpu import bf16_ops

    if request.param == "gguf-bf16" and not bf16_ops.available():
        pytest.skip(f"gguf-bf16 needs AMX-BF16 tiles: {bf16_ops.tile_path()}")

    config = EngineConfig(
        model=model_smollm2_dir, max_model_len=512, max_num_seqs=8, quantization=request.param
    )
    return EngineCore(config)


def _hidden(core, spans_and_ids, program: bool, lora_slots=None) -> torch.Tensor:
    from kernels.metadata import SeqSpan

    backend = core.runner.attention
    bs = core.runner.block_size
    spans, ids, positions, slots = [], [], [], []
    for start, tokens, blocks in spans_and_ids:
        spans.append(SeqSpan(start, len(tokens), blocks))
        ids += tokens
        for p in range(start, start + len(tokens)):
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
    meta = backend.build_metadata(spans, slots, bs, torch.device("cpu"))
    ids_t, pos_t = torch.tensor(ids), torch.tensor(positions)
    with torch.inference_mode():
        if program:
            return backend.run_program(ids_t, pos_t, meta, lora_slots).clone()
        return core.model(ids_t, pos_t, meta).clone()


def test_the_program_replays_the_eager_forward_bitwise(core) -> None:
    backend = core.runner.attention
    assert backend.program is not None, "the fast path's forward was not captured"
    # 1 embedding + 11 kernels per layer (norm, qkv, 2 rotary, KV write, attention, o_proj,
    # norm, gate_up, silu, down) + the final norm.
    assert backend.num_program_ops == 1 + 11 * core.model.num_layers + 1
    gen = torch.Generator().manual_seed(3)

    def toks(n: int) -> list[int]:
        return torch.randint(10, 40000, (n,), generator=gen).tolist()

    steps = [
        [(0, toks(37), [1, 2, 3])],  # one prefill chunk
        [(37, toks(1), [1, 2, 3]), (0, toks(20), [5, 6])],  # a decode and a new chunk
        [(38, toks(1), [1, 2, 3]), (20, toks(1), [5, 6]), (0, toks(5), [9])],
    ]
    for step in steps:
        # The same cache state for both runs: each step writes the same slots.
        eager = _hidden(core, step, program=False)
        replayed = _hidden(core, step, program=True)
        assert torch.equal(eager, replayed)
        assert eager.shape == (sum(len(t) for _, t, _ in step), core.model.hidden_size)


def test_a_forward_with_a_torch_op_between_kernels_is_not_captured(core, monkeypatch) -> None:
    """A layer that computes with torch between C kernels cannot be replayed: capture
    refuses (and the engine then runs eagerly) instead of recording a stale pointer."""
    from engine.layers.activation import SiluAndMul

    def torch_silu(self, gate_up):
        return torch.nn.functional.silu(gate_up[:, : gate_up.shape[1] // 2]).contiguous()

    monkeypatch.setattr(SiluAndMul, "forward", torch_silu)
    backend = core.runner.attention
    saved = backend.program
    try:
        assert backend.capture_program(core.model, core.runner.block_size) is None
    finally:
        backend.program = saved


def test_the_lora_program_replays_the_eager_forward_with_adapters(model_smollm2_dir, tmp_path):
    """With LoRA hooks, a second program holds one LoRA op per linear: a step mixing base
    tokens and two adapters gives bitwise the eager forward's rows (the hooks' C kernel),
    and not the base program's."""
    from engine.core import EngineCore
    from kernels import LoRAStep
    from tests.lora_adapters import write_random_adapter

    adapters = tuple(
        (name, write_random_adapter(model_smollm2_dir, tmp_path / name, seed=i, b_scale=0.05))
        for i, name in enumerate(("a", "b"), start=1)
    )
    core = EngineCore(
        EngineConfig(
            model=model_smollm2_dir, max_model_len=512, max_num_seqs=8, quantization="gguf",
            enable_lora=True, max_loras=2, lora_modules=adapters,
        )
    )  # fmt: skip
    backend = core.runner.attention
    assert backend.lora_program is not None
    linears_per_layer = 4  # qkv, o, gate_up, down: one LoRA op each
    assert backend.lora_program.num_ops == backend.num_program_ops + linears_per_layer * 30
    slot_a, _ = core.lora.acquire("a")
    slot_b, _ = core.lora.acquire("b")
    gen = torch.Generator().manual_seed(4)

    def toks(n: int) -> list[int]:
        return torch.randint(10, 40000, (n,), generator=gen).tolist()

    step = [(0, toks(9), [1, 2]), (0, toks(1), [5]), (0, toks(6), [9])]
    token_slots = [slot_a] * 9 + [-1] + [slot_b] * 6
    lora = LoRAStep.build(token_slots, torch.device("cpu"))
    core.lora.context.step = lora
    try:
        eager = _hidden(core, step, program=False)
    finally:
        core.lora.context.step = None
    replayed = _hidden(core, step, program=True, lora_slots=lora.token_slots)
    assert torch.equal(eager, replayed)
    base = _hidden(core, step, program=True)
    assert torch.equal(base[9], replayed[9]), "the base token is the base program's"
    assert not torch.equal(base[:9], replayed[:9]) and not torch.equal(base[10:], replayed[10:])


def test_a_qwen3_forward_with_per_head_norms_is_a_program(tmp_path) -> None:
    """Qwen3's q / k norms run as one kernel each (`head_rms_norm` on the strided q and k):
    its forward is captured (13 kernels a layer) and replays the eager forward bitwise."""
    from transformers import Qwen3Config

    from engine.core import EngineCore
    from tests.engine.tiny_models import COMMON, save_random_config
    from tests.gpu.gpu_models import write_tokenizer

    config = Qwen3Config(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=32
    )
    save_random_config(config, tmp_path)
    write_tokenizer(tmp_path, config.vocab_size)
    core = EngineCore(EngineConfig(model=str(tmp_path), quantization="q8_0", max_model_len=96))
    backend = core.runner.attention
    assert backend.program is not None, "the Qwen3 forward was not captured"
    assert backend.num_program_ops == 1 + 13 * core.model.num_layers + 1
    gen = torch.Generator().manual_seed(4)

    def toks(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    for step in ([(0, toks(11), [1, 2, 3])], [(11, toks(1), [1, 2, 3]), (0, toks(6), [5, 6])]):
        eager = _hidden(core, step, program=False)
        assert torch.equal(eager, _hidden(core, step, program=True))


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_a_moe_forward_is_a_program(name: str, tmp_path) -> None:
    """With routers of whole 8-row groups (on the C kernels), a MoE block is one op
    (`moe_block`: each token's softmax top-k from the router's logits, then its experts in
    one call), so a MoE forward is a step program (Qwen3-MoE's dense layer and per-head
    norms included) and replays the eager forward bitwise."""
    from engine.core import EngineCore
    from tests.engine.moe_models import CONFIGS
    from tests.engine.tiny_models import save_random_config
    from tests.gpu.gpu_models import write_tokenizer

    config = CONFIGS[name]()
    config.head_dim = 32  # the C attention's unit
    if name == "mixtral":
        config.num_local_experts = 8
    else:  # and its dense layer's width whole 32-column blocks, on the C kernels too
        config.num_experts, config.intermediate_size = 8, 96
    save_random_config(config, tmp_path)
    write_tokenizer(tmp_path, config.vocab_size)
    core = EngineCore(EngineConfig(model=str(tmp_path), quantization="q8_0", max_model_len=96))
    backend = core.runner.attention
    assert backend.program is not None, f"the {name} forward was not captured"
    gen = torch.Generator().manual_seed(6)

    def toks(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    for step in (
        [(0, toks(13), [1, 2, 3, 4])],
        [(13, toks(1), [1, 2, 3, 4]), (0, toks(9), [5, 6, 7])],
    ):
        eager = _hidden(core, step, program=False)
        assert torch.equal(eager, _hidden(core, step, program=True))


def test_a_gemma3_forward_is_a_program(tmp_path) -> None:
    """Gemma 3's scaled embedding, GeGLU and sandwich norms are C kernels on the fast path,
    so its forward (sliding and global layers) is a step program, bitwise its eager
    forward."""
    from transformers import Gemma3TextConfig

    from engine.core import EngineCore
    from tests.engine.tiny_models import COMMON, save_random_config
    from tests.gpu.gpu_models import write_tokenizer

    config = Gemma3TextConfig(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 6},
        head_dim=32, query_pre_attn_scalar=32, sliding_window=6, final_logit_softcapping=30.0,
    )  # fmt: skip
    save_random_config(config, tmp_path)
    write_tokenizer(tmp_path, config.vocab_size)
    core = EngineCore(EngineConfig(model=str(tmp_path), quantization="q8_0", max_model_len=96))
    assert core.runner.attention.program is not None, "the Gemma 3 forward was not captured"
    gen = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    for step in (
        [(0, toks(15), [1, 2, 3, 4])],
        [(15, toks(1), [1, 2, 3, 4]), (0, toks(8), [5, 6])],
    ):
        eager = _hidden(core, step, program=False)
        assert torch.equal(eager, _hidden(core, step, program=True))
