"""Write a GGUF file again with its tensors in another GGML type, metadata kept.

    python -m tools.requantize_gguf SRC.gguf OUT.gguf --type Q4_K_M

How the K-quant fast path was measured without a download: the embedded SmolLM2 file
(Q4_1) written as llama.cpp's Q4_K_M mix (or any type `tools/kquants.py` quantizes), its
tokenizer, chat template and every other key copied, so `tools.quality --model OUT.gguf`
scores real text. Each tensor is dequantized by gguf-py and quantized again, so the new
file holds the old one's values quantized twice: it measures hearth's reading of the
format, not the format's quality against the original checkpoint.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from tools.kquants import quantize, tensor_type


def copy_metadata(reader: Any, writer: Any, drop: tuple[str, ...] = ()) -> None:
    """Every metadata key of a `gguf.GGUFReader` into a `gguf.GGUFWriter` of the same
    architecture, but `drop` and those the writer writes itself (the architecture, the
    reader's own `GGUF.*` fields)."""
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (gguf.Keys.General.ARCHITECTURE, *drop):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def requantize(src: Path, out: Path, qtype: str) -> Counter[str]:
    """Write `src` to `out` with every 2-D tensor in `qtype`'s types; returns their counts."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(reader, writer, drop=(gguf.Keys.General.FILE_TYPE,))
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}", gguf.LlamaFileType.GUESSED)
    writer.add_file_type(file_type)
    counts: Counter[str] = Counter()
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        kind = tensor_type(qtype, tensor.name, values.shape, n_layers)
        counts[kind or "F32"] += 1
        if kind is None:
            writer.add_tensor(tensor.name, values)
        else:
            raw = quantize(values, kind)
            writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.requantize_gguf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="GGML type or Q4_K_M (default)")
    args = parser.parse_args(argv)
    counts = requantize(args.src, args.out, args.type)
    print(f"{args.out}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
