"""The quality bar of a precision mode: teacher-forced against the exact float32 mode.

    python -m tools.quality [--tokens 20000] [--window 512] [--model DIR_OR_GGUF]

Feeds the same fixed corpus through the engine's model in the exact mode
(`--quantization none`, float32, bit-faithful to transformers) and in each faster mode,
window by window, and compares the next-token distributions at every position:
mean KL(exact || mode) in nats per token, top-1 agreement, and perplexity of each mode
on the corpus. A mode may be a default only if KL <= 0.01, top-1 >= 99 % and its
perplexity is within 1 % of the exact mode's (docs/performance.md).

The corpus is real public text that needs no download: the docstrings of a fixed list
of Python standard-library modules (PSF license), read from this interpreter, in a fixed
order. It is the same for a given Python version; the script prints its size and hash.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import sys
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from kernels.metadata import SeqSpan

CORPUS_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "math", "operator",
    "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "secrets", "shutil",
    "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "tokenize", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile",
)  # fmt: skip


def corpus_text() -> str:
    """Docstrings of CORPUS_MODULES and their public members, in a fixed order."""
    parts: list[str] = []
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        doc = inspect.getdoc(module)
        if doc:
            parts.append(doc)
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(doc)
    return "\n\n".join(parts)


@dataclass(frozen=True, slots=True)
class Quality:
    mode: str
    tokens: int
    kl: float
    top1: float
    ppl: float
    ppl_exact: float

    @property
    def passes(self) -> bool:
        return self.kl <= 0.01 and self.top1 >= 0.99 and abs(self.ppl / self.ppl_exact - 1) <= 0.01


def _window_logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one fresh sequence prefilled in one step."""
    runner = core.runner
    bs = runner.block_size
    n = len(ids)
    blocks = list(range(-(-n // bs)))
    meta = runner.attention.build_metadata(
        [SeqSpan(0, n, blocks)], list(range(n)), bs, runner.device
    )
    positions = torch.arange(n, dtype=torch.long)
    with torch.inference_mode():
        hidden = core.model(torch.tensor(ids, dtype=torch.long), positions, meta)
        return core.model.compute_logits(hidden).float()


def measure(
    model: str | None, modes: list[str], num_tokens: int, window: int, say=print
) -> list[Quality]:
    """Quality of each of `modes` (``--quantization`` values) against the exact mode."""
    exact = EngineCore(
        EngineConfig(
            model=model, quantization="none", dtype="float32", num_kv_blocks=window // 16 + 2
        )
    )
    from engine.tokenizer import Tokenizer

    text = corpus_text()
    ids = Tokenizer(exact.model_info.model_dir).encode(text, add_special_tokens=False)[:num_tokens]
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    say(
        f"corpus: {len(ids)} tokens of stdlib docstrings (Python {sys.version.split()[0]}, sha256 {digest})"
    )
    windows = [
        ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1
    ]
    cores = {}
    for m in modes:  # "gguf" or "gguf/float32": --quantization [/ --kv-cache-dtype]
        quantization, _, kv = m.partition("/")
        config = EngineConfig(
            model=model,
            quantization=quantization,
            kv_cache_dtype=kv or "auto",
            num_kv_blocks=window // 16 + 2,
        )
        cores[m] = EngineCore(config)
    stats = {m: [0.0, 0, 0.0] for m in modes}  # kl sum, top1 hits, nll sum
    nll_exact = 0.0
    count = 0
    for wi, win in enumerate(windows):
        ref = torch.log_softmax(_window_logits(exact, win), dim=-1)[:-1]
        targets = torch.tensor(win[1:])
        nll_exact -= float(ref.gather(1, targets[:, None]).sum())
        count += len(win) - 1
        for m, core in cores.items():
            lp = torch.log_softmax(_window_logits(core, win), dim=-1)[:-1]
            kl = (ref.exp() * (ref - lp)).sum(-1)
            s = stats[m]
            s[0] += float(kl.sum())
            s[1] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            s[2] -= float(lp.gather(1, targets[:, None]).sum())
        if (wi + 1) % 8 == 0 or wi + 1 == len(windows):
            say(f"  {count} tokens scored ({wi + 1}/{len(windows)} windows)")
    ppl_exact = math.exp(nll_exact / count)
    return [
        Quality(
            mode=f"{m} ({cores[m].backends.description})",
            tokens=count,
            kl=s[0] / count,
            top1=s[1] / count,
            ppl=math.exp(s[2] / count),
            ppl_exact=ppl_exact,
        )
        for m, s in stats.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument(
        "--mode",
        action="append",
        default=None,
        help="--quantization value(s) to check, optionally /KV_CACHE_DTYPE, e.g. gguf/float16 "
        "(default: the GGUF mode --quantization auto runs on this host, gguf or gguf-bf16)",
    )
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args(argv)
    from engine.backends import auto_gguf_mode

    results = measure(args.model, args.mode or [auto_gguf_mode()], args.tokens, args.window)
    print("| mode | tokens | mean KL (nat/token) | top-1 agreement | perplexity (exact) | passes |")
    print("|---|---|---|---|---|---|")
    for q in results:
        print(
            f"| {q.mode} | {q.tokens} | {q.kl:.2e} | {q.top1 * 100:.2f} % | "
            f"{q.ppl:.4f} ({q.ppl_exact:.4f}) | {'yes' if q.passes else 'NO'} |"
        )
    return 0 if all(q.passes for q in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
