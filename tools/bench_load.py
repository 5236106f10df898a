"""Start-up cost of a model: seconds from nothing to a ready engine, and the peak resident
memory on the way, each run in a fresh process.

    python -m tools.bench_load DIR [--runs 2] [-- extra EngineConfig fields as k=v]
    python -m tools.bench_load DIR --make [--layers 16 --hidden 2048 --intermediate 5632
        --dtype bfloat16]

`--make` first writes a random Llama checkpoint of that shape into DIR (the embedded
model's tokenizer, untied head), so the cost of a model far bigger than the embedded one
can be measured without a download. Each run builds an `EngineCore` (load, pack, KV
cache, warm-up) in a child process and prints its wall time, `ru_maxrss` (the peak, which
counts the checkpoint's memory-mapped pages as well: those are page cache the kernel can
drop) and the anonymous memory it holds once ready.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from engine.config import EngineConfig
from engine.core import EngineCore
fields = json.loads(sys.argv[1])
core = EngineCore(EngineConfig(**fields), progress=lambda m: print("  " + m, file=sys.stderr))
ready = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
anon = int(status["RssAnon"].split()[0]) / 2**20
print(json.dumps({"ready_s": ready, "peak_gib": peak, "anon_gib": anon,
                  "backend": core.backends.description}))
"""


def make_model(directory: Path, layers: int, hidden: int, intermediate: int, dtype: str) -> None:
    """A random Llama checkpoint (safetensors in `dtype`) with the embedded model's
    tokenizer: 64-wide heads, a quarter as many KV heads, untied head."""
    import torch
    from safetensors.torch import save_file

    from engine.model_resolver import resolve_model_dir

    source = Path(resolve_model_dir(None, None))
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):  # fmt: skip
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    heads = hidden // 64
    kv = max(1, heads // 4)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": dtype, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dt)

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}"
        return {
            f"{p}.self_attn.q_proj.weight": rand(hidden, hidden),
            f"{p}.self_attn.k_proj.weight": rand(kv * 64, hidden),
            f"{p}.self_attn.v_proj.weight": rand(kv * 64, hidden),
            f"{p}.self_attn.o_proj.weight": rand(hidden, hidden),
            f"{p}.mlp.gate_proj.weight": rand(intermediate, hidden),
            f"{p}.mlp.up_proj.weight": rand(intermediate, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, intermediate),
            f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=dt),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=dt),
        }

    # One shard per 4 layers (and one for the embedding, head and final norm), with the
    # index a sharded checkpoint has: a model bigger than memory is written piece by piece.
    pieces = [range(i, min(i + 4, layers)) for i in range(0, layers, 4)]
    total = len(pieces) + 1
    weight_map: dict[str, str] = {}
    n = 0
    for s in range(total):
        if s == 0:
            tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
                       "lm_head.weight": rand(vocab, hidden),
                       "model.norm.weight": torch.ones(hidden, dtype=dt)}  # fmt: skip
        else:
            tensors = {k: v for i in pieces[s - 1] for k, v in layer(i).items()}
        name = f"model-{s + 1:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        n += sum(t.numel() for t in tensors.values())
        print(f"  {name}", flush=True)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {directory}: {n / 1e9:.2f} B params, {dtype}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model directory")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--make", action="store_true", help="write a random Llama there first")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("fields", nargs="*", help="EngineConfig fields, k=v (after --)")
    args = parser.parse_intermixed_args(argv)  # fields after options, as the usage shows
    directory = Path(args.model)
    if args.make:
        make_model(directory, args.layers, args.hidden, args.intermediate, args.dtype)
    fields: dict[str, object] = {"model": str(directory)}
    for item in args.fields:
        key, _, value = item.partition("=")
        fields[key] = json.loads(value) if value[:1].isdigit() else value
    for run in range(args.runs):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(fields)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"run {run + 1}: ready in {figures['ready_s']:.1f} s, peak RSS "
            f"{figures['peak_gib']:.2f} GiB (file pages of the checkpoint included), "
            f"anonymous memory when ready {figures['anon_gib']:.2f} GiB ({figures['backend']})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
