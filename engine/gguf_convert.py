"""Convert a GGUF file into a Hugging Face directory (config, tokenizer, and when asked the
weights dequantized): the conversion child.

Only the child process that `engine.model_resolver` starts (a fresh interpreter) imports
this module, so the heavy modelling imports (torch, transformers) and the ~1 GB peak of
the conversion never live in the gunicorn master or the CLI. Where the result is cached,
and when a conversion runs at all, is `engine.model_resolver`'s job.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ConversionRefused", "convert", "main"]


class ConversionRefused(ValueError):
    """The file is a GGUF hearth does not convert (the message says why and what is)."""


_SHARD_BYTES = 1 << 30
"""Size at which the streaming conversion starts a new safetensors shard."""


def _unplaced_or_missing(
    gguf_path: Path,
    arch: str,
    reader: Any,
    model: Any,
    written: set[str],
    experts: dict[str, list[str]] | None = None,
) -> None:
    """Refuse a file with a tensor the model has no place for, or that leaves a model
    weight unwritten (a tied head excepted; a parameter stacked over the experts is
    written when each of its `experts` parts is: `GGUFLayout.experts`)."""
    from engine.gguf_arch import unplaced_tensors

    parameters = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if unplaced := unplaced_tensors(reader, arch, parameters):
        raise ConversionRefused(
            f"{gguf_path.name} ({arch}) holds {len(unplaced)} tensors {type(model).__name__} "
            f"has no place for, e.g. {', '.join(unplaced[:3])}: its config is not one "
            "transformers' GGUF loader reads"
        )
    tied = "lm_head.weight" if model.config.tie_word_embeddings else None
    written = written | {n for n, parts in (experts or {}).items() if written.issuperset(parts)}
    missing = sorted(n for n in dict(model.named_parameters()) if n not in written and n != tied)
    if missing:
        raise ConversionRefused(
            f"{gguf_path.name} ({arch}) does not provide {len(missing)} weights of "
            f"{type(model).__name__}, e.g. {', '.join(missing[:3])}"
        )


def _convert_streaming(gguf_path: Path, reader: Any, arch: str, config: Any, out_dir: Path) -> None:
    """Dequantize the file tensor by tensor into safetensors shards of `_SHARD_BYTES`:
    the same names and values as transformers' loader gives (its own tensor processor
    and name map, float32: `engine.gguf_checkpoint`), without ever holding the model.
    transformers' loader keeps every dequantized tensor and then the model, ~2x the
    float32 model at peak (a 3 B GGUF would need ~26 GB to convert); this needs one shard
    and one tensor."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    checkpoint, model = _checkpoint(gguf_path, config, arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    shard: dict[str, np.ndarray] = {}  # the shard being filled, number `count + 1`
    written: dict[str, int] = {}  # checkpoint name -> shard number
    count = 0

    def flush() -> None:
        nonlocal count
        count += 1
        save_file(shard, str(out_dir / f"shard-{count}.tmp"), metadata={"format": "pt"})
        shard.clear()

    for hf_name, tensor in _tensors(checkpoint):
        weights = tensor.numpy()
        if shard and sum(a.nbytes for a in shard.values()) + weights.nbytes > _SHARD_BYTES:
            flush()
        shard[hf_name] = weights
        written[hf_name] = count + 1
    _unplaced_or_missing(gguf_path, arch, reader, model, set(written), checkpoint.layout.experts)
    if shard or count == 0:
        flush()
    names = {i: f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    if count == 1:
        names[1] = "model.safetensors"
    for i, final in names.items():
        (out_dir / f"shard-{i}.tmp").rename(out_dir / final)
    if count > 1:
        index = {"metadata": {}, "weight_map": {n: names[i] for n, i in sorted(written.items())}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _save_config(config, model, out_dir)


def _convert_in_place(gguf_path: Path, reader: Any, arch: str, config: Any, out_dir: Path) -> None:
    """Write the config, the file's `GGUFLayout` and its path only: the engine reads the weights
    from the file itself (`engine.gguf_checkpoint`). Every tensor is still checked here,
    once — placed, of the right shape, none missing — without dequantizing a matrix whose
    row order is known (`GGUFCheckpoint.tensors` with every matrix unread)."""
    import json

    from engine.model_resolver import CONVERSION_MARKER

    checkpoint, model = _checkpoint(gguf_path, config, arch)
    matrices = {n for n, shape in checkpoint.expected.items() if len(shape) == 2}
    written = {name for name, _ in _tensors(checkpoint, matrices)}
    _unplaced_or_missing(gguf_path, arch, reader, model, written, checkpoint.layout.experts)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.layout.save(out_dir)
    # Where the weights are; the resolver writes its own marker over this one, with the
    # file's size and time (a directory converted by hand keeps this).
    marker = {"source": str(gguf_path.resolve())}
    (out_dir / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    _save_config(config, model, out_dir)


def _checkpoint(gguf_path: Path, config: Any, arch: str) -> tuple[Any, Any]:
    """The file read as transformers' checkpoint for `config`, and transformers' model for
    it on the meta device."""
    from engine.gguf_checkpoint import GGUFCheckpoint, GGUFLayout
    from engine.layers.gguf_linear import GGUFSource

    source = GGUFSource(gguf_path)
    layout, model = GGUFLayout.of_config(config, arch, source)
    return GGUFCheckpoint(gguf_path, layout, source), model


def _tensors(checkpoint: Any, unread: set[str] | None = None) -> Iterator[tuple[str, Any]]:
    """`checkpoint.tensors(unread)`, a tensor of the wrong shape refused by name."""
    from engine.gguf_checkpoint import WrongShapeError

    try:
        yield from checkpoint.tensors(unread or ())
    except WrongShapeError as exc:
        raise ConversionRefused(str(exc)) from None


def _save_config(config: Any, model: Any, out_dir: Path) -> None:
    import torch
    from transformers import GenerationConfig

    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    if model.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def _memoize_gguf_parsing(gguf: ModuleType) -> None:
    """Memoize two pure `gguf` entry points for the rest of this (throwaway) child process.

    transformers 5.19 parses the whole file with `GGUFReader` twice per load (about 5 s
    each for SmolLM2's 49k-token vocabulary) and rebuilds `get_tensor_name_map(arch,
    n_blocks)` once per tensor (another ~7 s); memoized, the SmolLM2 conversion takes
    about 12 s instead of 26 s. Readers are read-only after parsing and name maps are
    pure, so sharing them changes no result. transformers imports both names from
    `gguf` at call time, which is what makes patching the module enough; if a later
    gguf drops either name, the conversion simply runs unpatched.
    """
    import functools

    reader_cls = getattr(gguf, "GGUFReader", None)
    name_map = getattr(gguf, "get_tensor_name_map", None)
    if reader_cls is not None:
        cached_reader = functools.lru_cache(maxsize=2)(reader_cls)

        def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
            return cached_reader(os.fspath(path), mode)

        gguf.GGUFReader = reader
    if name_map is not None:
        gguf.get_tensor_name_map = functools.cache(name_map)


def main(argv: list[str]) -> None:
    """Child-process entry point: convert GGUF `argv[0]` into directory `argv[1]`; with
    `--weights` after them, every weight dequantized into safetensors (a plain HF
    checkpoint), else config and tokenizer only (the engine reads the weights from the file).

    A file that cannot be read, or that `engine.gguf_arch.refusal` refuses, exits with
    code 2 and one line on stderr, before torch is imported.
    """
    paths = [a for a in argv if a != "--weights"]
    if len(paths) != 2:
        print("usage: python -m engine.gguf_convert FILE.gguf OUT_DIR [--weights]", file=sys.stderr)
        raise SystemExit(2)
    import gguf

    _memoize_gguf_parsing(gguf)
    try:
        convert(Path(paths[0]), Path(paths[1]), weights="--weights" in argv)
    except ConversionRefused as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None


def convert(gguf_path: Path, out_dir: Path, *, whole: bool = False, weights: bool = True) -> None:
    """Convert `gguf_path` into an HF directory `out_dir`: its config (with the fields
    transformers' loader misses read from the file: `engine.gguf_arch.fixed_config`) and
    tokenizer, and with `weights` every tensor dequantized to float32 (exact for the
    quantized formats) into safetensors.

    Without `weights` the directory holds no weights: the engine reads them from the file
    (`_convert_in_place`, `engine.gguf_checkpoint`). With them, they stream, tensor by
    tensor (`_convert_streaming`); `whole=True` (the tests' reference) goes through
    transformers' whole-model loader instead. A model with a parameter the file did not
    provide is refused, never saved half random.
    """
    # Parse the file first (gguf + numpy only): a broken file or an architecture we
    # cannot serve fails here, before the torch import. Under `main` the parse is
    # memoized, so transformers reuses it instead of parsing again.
    import gguf

    from engine.gguf_arch import fixed_config, metadata, refusal

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        meta = metadata(reader)
        arch = str(meta["general.architecture"])
    except Exception as exc:
        raise ConversionRefused(f"cannot read {gguf_path} as a GGUF file: {exc!r}") from None
    if (why := refusal(arch, meta)) is not None:
        raise ConversionRefused(why)

    from transformers import AutoConfig, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        config = fixed_config(
            AutoConfig.from_pretrained(directory, gguf_file=name), arch, meta, reader
        )
    except ValueError as exc:  # the file says something fixed_config can't take
        raise ConversionRefused(f"{gguf_path.name} ({arch}): {exc}") from None
    if whole:
        _convert_whole(gguf_path, reader, arch, config, out_dir)
    elif weights:
        _convert_streaming(gguf_path, reader, arch, config, out_dir)
    else:
        _convert_in_place(gguf_path, reader, arch, config, out_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)


def _convert_whole(gguf_path: Path, reader: Any, arch: str, config: Any, out_dir: Path) -> None:
    """transformers' own GGUF loading: the model built from the file, then saved. The
    quantizer and its config entry are dropped so the directory is a plain checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32,
        output_loading_info=True,
    )  # fmt: skip
    if info["mismatched_keys"]:
        raise ConversionRefused(
            f"{gguf_path.name} ({arch}): weights of the wrong shape for "
            f"{type(model).__name__}, e.g. {', '.join(str(k) for k in info['mismatched_keys'][:3])}"
        )
    written = {n for n, _ in model.named_parameters()} - set(info["missing_keys"])
    _unplaced_or_missing(gguf_path, arch, reader, model, written)
    model.hf_quantizer = None
    # Saved as a checkpoint of this class is on the hub (per-expert MoE tensors, ...): the
    # conversions transformers recorded while reading the GGUF do not describe that layout.
    model._weight_conversions = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)


if __name__ == "__main__":  # python -m engine.gguf_convert FILE DIR [--weights]
    main(sys.argv[1:])
