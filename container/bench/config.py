"""What one `hearth bench` pass measures: the sweeps, their levels and how many requests each.

Issue 7 asks for two sweeps, both with the method of `vllm bench serve --dataset-name random
--ignore-eos --request-rate inf` (anchors/bench-serve.sh): a concurrency sweep (random
128-token prompts, 128 output tokens, at c = 1, 4, 16, 64, 128) and a prompt-length sweep
(128, 1024 and 4096 tokens in at c = 16). Each point of a sweep is a `LevelSpec`; a
`BenchConfig` turns the command line into the ordered list of them, so the load generator
never needs to know which sweep a level belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SWEEP_CONCURRENCY = "concurrency"
SWEEP_PROMPT_LEN = "prompt-len"
SWEEPS = (SWEEP_CONCURRENCY, SWEEP_PROMPT_LEN)
DEFAULT_CONCURRENCIES = (1, 4, 16, 64, 128)
DEFAULT_PROMPT_LENS = (128, 1024, 4096)
DEFAULT_PROMPT_LEN_CONCURRENCY = 16
# The random token ids stay away from both ends of the vocabulary, where the special and
# byte tokens live ([1000, vocab - 1000)).
TOKEN_ID_MARGIN = 1000


@dataclass(frozen=True)
class LevelSpec:
    """One point of a sweep: `num_prompts` requests behind a semaphore of `concurrency`."""

    sweep: str
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int

    @property
    def x(self) -> int:
        """The value the sweep varies: what the table's first column and the plot's axis show."""
        return self.input_len if self.sweep == SWEEP_PROMPT_LEN else self.concurrency


@dataclass(frozen=True)
class BenchConfig:
    """One pass's parameters; frozen so a repeat or a second server cannot drift from the first.

    `concurrencies`/`num_prompts`/`input_len`/`output_len` describe the concurrency sweep;
    `prompt_lens` (empty: none) the prompt-length sweep at `prompt_len_concurrency`.
    `concurrencies` may be empty when only the prompt-length sweep is wanted.
    """

    base_url: str
    model: str
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES
    num_prompts: tuple[int, ...] = ()  # empty: `default_num_prompts` for each level
    input_len: int = 128
    output_len: int = 128
    prompt_lens: tuple[int, ...] = ()
    prompt_len_concurrency: int = DEFAULT_PROMPT_LEN_CONCURRENCY
    prompt_len_num_prompts: int = 0  # 0: `default_num_prompts(prompt_len_concurrency)`
    quick: bool = False
    seed: int = 0
    vocab_size: int = 49152
    api_key: str | None = None
    warmup: int = 1
    timeout_s: float = 600.0
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.concurrencies and not self.prompt_lens:
            raise ValueError("nothing to run: no concurrency level and no prompt length")
        if min((*self.concurrencies, self.prompt_len_concurrency)) < 1:
            raise ValueError("concurrency levels must be >= 1")
        if min((self.input_len, self.output_len, *self.prompt_lens)) < 1:
            raise ValueError("input and output lengths must be >= 1")
        if self.prompt_len_num_prompts < 0:
            raise ValueError("--prompt-len-num-prompts must be >= 1")
        if self.vocab_size <= 2 * TOKEN_ID_MARGIN:
            raise ValueError(f"vocab size must exceed {2 * TOKEN_ID_MARGIN}")
        resolve_num_prompts(self.concurrencies, self.num_prompts)  # raises on a bad pairing

    @property
    def levels(self) -> list[LevelSpec]:
        """Every level in the order it runs: the concurrency sweep, then the prompt lengths."""
        counts = resolve_num_prompts(self.concurrencies, self.num_prompts, self.quick)
        levels = [
            LevelSpec(SWEEP_CONCURRENCY, c, self.input_len, self.output_len, n)
            for c, n in zip(self.concurrencies, counts, strict=True)
        ]
        c = self.prompt_len_concurrency
        n = self.prompt_len_num_prompts or default_num_prompts(c, self.quick)
        levels += [
            LevelSpec(SWEEP_PROMPT_LEN, c, length, self.output_len, n)
            for length in self.prompt_lens
        ]
        return levels

    @property
    def max_total_len(self) -> int:
        """The longest prompt plus its output: the context a server must accept."""
        return max((self.input_len, *self.prompt_lens)) + self.output_len

    def public(self) -> dict[str, Any]:
        """The parameters recorded in results.json (never the API key)."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "levels": [
                {
                    "sweep": spec.sweep,
                    "concurrency": spec.concurrency,
                    "input_len": spec.input_len,
                    "num_prompts": spec.num_prompts,
                }
                for spec in self.levels
            ],
            "input_len": self.input_len,
            "output_len": self.output_len,
            "prompt_lens": list(self.prompt_lens),
            "quick": self.quick,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "warmup": self.warmup,
        }


def default_num_prompts(concurrency: int, quick: bool = False) -> int:
    """How many requests a level gets unless told.

    Full: 8 at c=1, 4 per slot up to c=16, 2 per slot above (the anchors' sandwich RUNS
    "1:8 16:64 64:128"), so every slot sees several requests and the tails are measured.
    Quick: 4 at c=1, one per slot above, so a whole sweep fits a few minutes on two cores;
    its figures are rougher (one wave per level), never to be quoted against full ones.
    """
    if quick:
        return max(4, concurrency)
    if concurrency == 1:
        return 8
    return 4 * concurrency if concurrency <= 16 else 2 * concurrency


def resolve_num_prompts(
    concurrencies: Sequence[int], given: Sequence[int], quick: bool = False
) -> list[int]:
    """No value: the defaults; one value: for every level; else one value per level."""
    if not given:
        return [default_num_prompts(c, quick) for c in concurrencies]
    if min(given) < 1:
        raise ValueError("--num-prompts values must be >= 1")
    if len(given) == 1:
        return [given[0]] * len(concurrencies)
    if len(given) == len(concurrencies):
        return list(given)
    raise ValueError(
        f"--num-prompts takes one value or one per concurrency level ({len(concurrencies)}), "
        f"got {len(given)}"
    )
