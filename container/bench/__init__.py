"""`hearth bench`: the benchmark client, one job per module.

- `config`  — the sweeps (concurrency, prompt length) and their levels (`BenchConfig`)
- `load`    — the load generator: random token-id prompts, streamed /v1/completions, timing
- `stats`   — per-request timings to a level's figures (percentiles, throughput, failures)
- `results` — saved results read back (earlier runs, vLLM result files), level keys
- `compare` — ratios between servers; median of sandwich passes, best vLLM dtype per level
- `report`  — stdout table, results.md, results.json
- `plot`    — results.svg
- `host`    — the CPU model and ISA flags every report names
- `server`  — spawning a server for one pass and stopping all it started
- `anchor`  — how the vLLM-CPU anchor is started (as serve-vllm-cpu.sh does)
- `session` — several servers in turn, never two at once (hearth, vLLM, hearth)
- `cli`     — argparse wiring

It is an HTTP client: it imports nothing of `handlers`, `engine` or `kernels`.
"""
