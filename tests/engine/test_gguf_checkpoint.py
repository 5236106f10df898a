"""A GGUF's weights read from the file at load (engine/gguf_checkpoint.py): what the
conversion records of transformers' tensor processor, loading without transformers' GGUF
code where the processor only reorders rows, and a file that is gone. (The tensors against
the dequantized checkpoint, bit for bit, for every architecture: tests/engine/
test_gguf_archs.py; deferral from the file: tests/engine/test_deferred_weights.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.gguf_checkpoint import AS_IS, PROCESSOR, GGUFLayout
from engine.model_resolver import WEIGHTS_IN_GGUF, ModelNotFoundError
from tests.engine.gguf_writer import write_gguf
from tests.engine.test_gguf_archs import CASES, _convert_marked, _save

ROOT = Path(__file__).resolve().parents[2]


def _in_file(name: str, directory: Path) -> Path:
    _save(CASES[name](), directory / "hf")
    path = write_gguf(directory / "hf", directory / f"{name}.gguf", qtype="Q8_0")
    _convert_marked(path, directory / "in-file")
    return directory / "in-file"


def test_llama_records_its_q_and_k_row_orders_and_reads_without_transformers_gguf_code(
    tmp_path: Path,
) -> None:
    """llama.cpp permutes Llama's Q and K rows (and biases) and transformers' processor undoes
    it: the conversion records the two orders (one per head layout, shared by every layer
    and by weight and bias); the rest is as stored. Loading then never imports transformers' GGUF module (~1.3 s)."""
    model_dir = _in_file("llama-untied-bias-headdim", tmp_path)
    layout = GGUFLayout.load(model_dir)
    reordered = {n for n, t in layout.treatments.items() if t not in (AS_IS, PROCESSOR)}
    layers = {n.split(".")[1] for n in reordered}
    assert reordered == {
        f"blk.{i}.attn_{p}.{w}" for i in layers for p in "qk" for w in ("weight", "bias")
    }
    assert len(layers) >= 2 and len(layout.orders) == 2
    assert PROCESSOR not in layout.treatments.values()
    for order in layout.orders:
        assert sorted(order) == list(range(len(order))) and order != sorted(order)
    code = (
        "import sys, torch\n"
        "from engine.model_loader import load_model\n"
        f"load_model({str(model_dir)!r}, torch.float32, torch.device('cpu'), lambda line: None)\n"
        "print('transformers.modeling_gguf_pytorch_utils' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_tensor_the_processor_changes_is_recorded_so_and_processed_at_load(
    tmp_path: Path,
) -> None:
    """Gemma's norms are stored as `1 + w` by llama.cpp and transformers' processor takes
    the 1 off: those are run through the processor at load (the values checked there:
    test_streaming_conversion_writes_what_transformers_loader_does[gemma3])."""
    layout = GGUFLayout.load(_in_file("gemma3", tmp_path))
    processed = {n for n, t in layout.treatments.items() if t == PROCESSOR}
    assert processed and all(n.endswith("norm.weight") for n in processed)
    assert all(t == AS_IS for n, t in layout.treatments.items() if n not in processed)


def test_a_directory_whose_gguf_is_gone_names_it(tmp_path: Path) -> None:
    import torch

    from engine.model_loader import load_model

    model_dir = _in_file("qwen3", tmp_path)
    assert (model_dir / WEIGHTS_IN_GGUF).is_file()
    (tmp_path / "qwen3.gguf").unlink()
    with pytest.raises(
        ModelNotFoundError, match=r"reads its weights from a GGUF file that is gone"
    ):
        load_model(str(model_dir), torch.float32, torch.device("cpu"), lambda line: None)
    marker = json.loads((model_dir / "hearth-conversion.json").read_text())
    assert marker["source"].endswith("qwen3.gguf")


def test_a_directory_converted_by_hand_names_its_file_and_loads(tmp_path: Path) -> None:
    """`python -m engine.gguf_convert FILE DIR` (no cache, no resolver): the directory
    records the file it reads from, and loads the weights a `--weights` conversion holds."""
    import torch
    from safetensors.torch import load_file

    from engine.gguf_convert import convert
    from engine.model_loader import load_model

    _save(CASES["qwen3"](), tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "q.gguf", qtype="Q4_1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "engine.gguf_convert", str(path), str(tmp_path / "by-hand")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    marker = json.loads((tmp_path / "by-hand" / "hearth-conversion.json").read_text())
    assert marker["source"] == str(path.resolve())
    convert(path, tmp_path / "full", weights=True)
    want = load_file(str(tmp_path / "full" / "model.safetensors"))
    model, _ = load_model(str(tmp_path / "by-hand"), torch.float32, torch.device("cpu"), print)
    got = dict(model.named_parameters())
    assert all(torch.equal(got[k], w) for k, w in want.items() if k in got)
    assert "model.layers.1.mlp.down_proj.weight" in got
