"""Dequantize a GGUF file into a plain Hugging Face directory: the conversion child.

Only the child process that `engine.model_resolver` starts (a fresh interpreter) imports
this module, so the heavy modelling imports (torch, transformers) and the ~1 GB peak of
the conversion never live in the gunicorn master or the CLI. Where the result is cached,
and when a conversion runs at all, is `engine.model_resolver`'s job.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ConversionRefused", "convert", "main"]


class ConversionRefused(ValueError):
    """The file is a GGUF hearth does not convert (the message says why and what is)."""


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
    """Child-process entry point: dequantize GGUF `argv[0]` into HF directory `argv[1]`.

    A file that cannot be read, or that `engine.gguf_arch.refusal` refuses, exits with
    code 2 and one line on stderr, before torch is imported.
    """
    import gguf

    _memoize_gguf_parsing(gguf)
    try:
        convert(Path(argv[0]), Path(argv[1]))
    except ConversionRefused as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` into a plain HF directory `out_dir`, with the config fields
    transformers' loader misses read from the file (`engine.gguf_arch.fixed_config`).

    transformers dequantizes every tensor to float32 (exact for the quantized formats);
    the engine casts to its serving dtype on load. The quantizer and its config entry
    are dropped so the saved directory is a plain, unquantized checkpoint. A model with
    a parameter the file did not provide is refused, never saved half random.
    """
    # Parse the file first (gguf + numpy only): a broken file or an architecture we
    # cannot serve fails here, before the torch import. Under `main` the parse is
    # memoized, so transformers reuses it instead of parsing again.
    import gguf

    from engine.gguf_arch import fixed_config, metadata, refusal, unplaced_tensors

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        meta = metadata(reader)
        arch = str(meta["general.architecture"])
    except Exception as exc:
        raise ConversionRefused(f"cannot read {gguf_path} as a GGUF file: {exc!r}") from None
    if (why := refusal(arch, meta)) is not None:
        raise ConversionRefused(why)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    config = fixed_config(AutoConfig.from_pretrained(directory, gguf_file=name), arch, meta, reader)
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, config=config, dtype=torch.float32, output_loading_info=True
    )
    parameters = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if unplaced := unplaced_tensors(reader, arch, parameters):
        raise ConversionRefused(
            f"{gguf_path.name} ({arch}) holds {len(unplaced)} tensors {type(model).__name__} "
            f"has no place for, e.g. {', '.join(unplaced[:3])}: its config is not one "
            "transformers' GGUF loader reads"
        )
    if info["missing_keys"] or info["mismatched_keys"]:
        missing = sorted(info["missing_keys"]) + [str(k) for k in info["mismatched_keys"]]
        raise ConversionRefused(
            f"{gguf_path.name} ({arch}) does not provide {len(missing)} weights of "
            f"{type(model).__name__}, e.g. {', '.join(missing[:3])}"
        )
    model.hf_quantizer = None
    # Saved as a checkpoint of this class is on the hub (per-expert MoE tensors, ...): the
    # conversions transformers recorded while reading the GGUF do not describe that layout.
    model._weight_conversions = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
