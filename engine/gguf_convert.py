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

__all__ = ["GGUF_ARCHITECTURES", "main"]

GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2"})
"""`general.architecture` values of GGUFs whose conversion `engine.models` can serve
(llama.cpp writes Llama, SmolLM and Mistral checkpoints as "llama")."""


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

    transformers dequantizes every tensor to float32 (exact for the quantized formats);
    the engine casts to its serving dtype on load. The quantizer and its config entry
    are dropped so the saved directory is a plain, unquantized checkpoint.
    """
    gguf_path, out_dir = Path(argv[0]), Path(argv[1])
    # Parse the file first (gguf + numpy only): a broken file or an architecture we
    # cannot serve fails here, before the torch import. The parse is memoized, so
    # transformers reuses it instead of parsing again.
    import gguf

    _memoize_gguf_parsing(gguf)
    try:
        arch = str(gguf.GGUFReader(str(gguf_path)).fields["general.architecture"].contents())
    except Exception as exc:
        print(f"cannot read {gguf_path} as a GGUF file: {exc!r}", file=sys.stderr)
        raise SystemExit(2) from None
    if arch not in GGUF_ARCHITECTURES:
        print(
            f"GGUF architecture {arch!r} is not served natively; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}",
            file=sys.stderr,
        )
        raise SystemExit(2)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
