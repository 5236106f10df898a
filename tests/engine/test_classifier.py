"""Sequence classifiers (`*ForSequenceClassification`, engine/models/classifier.py) in
the engine: each prompt, pooled at its last token through the score head, gives
transformers' float32 logits (tied and untied decoders, one and several labels, chunked
prefill, beside each other in one step; a bf16 one on the 16-bit kernels within float32 sum
order); the pooling config reads the labels and the
activation as vLLM does; a generation request is refused, and nothing is left in the KV
cache."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.messages import AddRequest, PoolingParams
from engine.pooling_config import read_pooling_config
from engine.sampling_params import SamplingParams
from kernels.cpu import ops
from tests.engine.engine_runs import blocks_core
from tests.engine.tiny_models import save_servable_classifier

PROMPTS = [[5, 17, 33, 2, 9], [44, 3, 120, 7, 7, 81, 12, 19, 250, 31, 8, 6, 77], [300]]
TOL = 1e-5


def make_core(model_dir: Path, **overrides: Any):
    from engine.core import EngineCore

    overrides.setdefault("max_num_seqs", 8)
    config = EngineConfig(model=str(model_dir), max_model_len=128, **overrides)
    return EngineCore(config, progress=lambda _: None)


def classify(core, prompts: list[list[int]]) -> list[np.ndarray]:
    for i, ids in enumerate(prompts):
        msg = AddRequest(
            request_id=f"c{i}",
            prompt_token_ids=ids,
            params=SamplingParams(max_tokens=0),
            pooling=PoolingParams(),
        )
        admission = core.add_request(msg)
        assert admission is not None and admission.accepted, admission
    outs = {}
    while core.has_work():
        for _, out in core.step():
            outs[out.request_id] = out
    assert core.block_manager.num_used_blocks == 0
    return [np.frombuffer(outs[f"c{i}"].embedding, dtype="<f4") for i in range(len(prompts))]


def reference(hf: torch.nn.Module, prompts: list[list[int]]) -> np.ndarray:
    with torch.inference_mode():
        return np.stack([hf(torch.tensor([ids])).logits[0].numpy() for ids in prompts])


@pytest.mark.parametrize(
    ("name", "num_labels"),
    [("llama-gqa-tied", 3), ("llama-untied-bias-headdim", 1), ("qwen3", 2), ("qwen2-qkv-bias", 1)],
)
def test_logits_match_transformers(tmp_path: Path, name: str, num_labels: int) -> None:
    hf = save_servable_classifier(name, tmp_path, num_labels)
    core = make_core(tmp_path)
    assert core.pooling.classifier is not None and core.pooling.classifier.num_labels == num_labels
    got = np.stack(classify(core, PROMPTS))
    expected = reference(hf, PROMPTS)
    assert got.shape == (len(PROMPTS), num_labels)
    worst = float(np.abs(got - expected).max())
    print(f"\n{name}: max |hearth - transformers| = {worst:.2e}")
    assert worst <= TOL


@pytest.mark.skipif(not ops.available(), reason="host has no AVX2: the C kernels do not run here")
def test_a_bf16_classifier_runs_the_16_bit_kernels_by_default(tmp_path: Path) -> None:
    """A reranker or classifier saved in bfloat16 with heads the C attention takes (32
    wide) runs the fast path like a causal LM: its decoder's linears packed from the held
    bf16 weights, the 2-label score head (not whole 8-row groups) widened back to float32
    and dense; on those blocks with float32 activations (`gguf`) the logits are
    transformers' on the same weights up to float32 sum order."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    save_servable_classifier("qwen3", tmp_path, 2, head_dim=32)
    path = tmp_path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path)
    hf = AutoModelForSequenceClassification.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    core = blocks_core(functools.partial(make_core, tmp_path), kv_cache_dtype="float32")
    assert "16-bit weights" in core.backends.description
    score = core.model.score
    assert score.packed is None and score.weight.dtype == torch.float32
    got = np.stack(classify(core, PROMPTS))
    assert np.abs(got - reference(hf, PROMPTS)).max() <= 1e-4


def test_chunked_prefill_pools_the_last_chunk(tmp_path: Path) -> None:
    hf = save_servable_classifier("qwen3", tmp_path, 2)
    core = make_core(tmp_path, max_num_batched_tokens=16, max_prefill_chunk=4)
    long = [(7 * i) % 500 + 1 for i in range(60)]
    got = classify(core, [long, PROMPTS[0]])
    assert np.abs(np.stack(got) - reference(hf, [long, PROMPTS[0]])).max() <= TOL


def test_generation_is_refused(tmp_path: Path) -> None:
    save_servable_classifier("llama-gqa-tied", tmp_path, 2)
    core = make_core(tmp_path)
    admission = core.add_request(
        AddRequest(request_id="g", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=3))
    )
    assert admission is not None and not admission.accepted
    assert "sequence classifier" in admission.message
    core.warm_up()  # a pooled prompt, not a generation
    assert core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("fields", "activation"),
    [
        ({}, "classify"),
        ({"problem_type": "regression"}, "identity"),
        ({"problem_type": "multi_label_classification"}, "sigmoid"),
        (
            {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
            "identity",
        ),
        (
            {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}},
            "classify",
        ),
    ],
)
def test_labels_and_activation_are_read_as_vllm_reads_them(
    tmp_path: Path, fields: dict[str, Any], activation: str
) -> None:
    save_servable_classifier("llama-gqa-tied", tmp_path, 2, id2label={0: "negative", 1: "positive"})
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(fields)
    config_path.write_text(json.dumps(config))
    pooling = read_pooling_config(tmp_path)
    assert pooling.classifier is not None
    assert pooling.classifier.labels == ["negative", "positive"]
    assert pooling.classifier.activation == activation
    assert pooling.unsupported is not None and "classif" in pooling.unsupported


def test_pairs_sharing_a_prefix_reuse_its_cached_blocks(tmp_path: Path) -> None:
    """A reranker's pairs share the query (and any template) before each document: the
    later pairs start after the first's cached blocks, with transformers' logits."""
    hf = save_servable_classifier("qwen3", tmp_path, 1)
    core = make_core(tmp_path)
    query = [(11 * i) % 400 + 3 for i in range(40)]
    pairs = [[*query, 7, 8, 9], [*query, 10, 11], [*query, 12]]
    first = classify(core, pairs[:1])
    hits = core.block_manager.num_prefix_hits
    rest = classify(core, pairs[1:])
    block = core.block_manager.block_size
    assert core.block_manager.num_prefix_hits - hits >= 2 * (len(query) // block) * block
    got = np.stack(first + rest)
    assert np.abs(got - reference(hf, pairs)).max() <= TOL
