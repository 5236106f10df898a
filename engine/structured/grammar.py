"""The grammar library behind structured outputs: xgrammar.

Chosen by measurement on the default model's tokenizer (SmolLM2, 49,152 tokens, this
2-core CPU): xgrammar compiled a 5-property JSON schema in ~6 ms and filled a token
mask in ~2 us (median; 86 us worst); llguidance compiled in ~14 ms, filled a mask in
~26 us (27 ms worst, its lazy first step) and its torch mask-apply path took tens of
seconds on CPU. xgrammar also reads GBNF/EBNF natively (vLLM's `grammar` format) and is
vLLM's default, so its error messages and schema coverage are what vLLM users know.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import TYPE_CHECKING

from engine.sampling_params import StructuredOutputSpec

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from engine.request import Request

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


def _xgrammar() -> types.ModuleType:
    """xgrammar, imported on first use: with the transformers it pulls in, the import
    takes ~1.5 s, which the engine would otherwise spend before it reports ready. The
    first use is the compiler's prewarm on the grammar thread, once the engine is idle
    (engine/core_loop.py), or a constrained request's compile if it comes first; a matcher
    or a mask only exists once a grammar compiled."""
    import xgrammar

    return xgrammar


class GrammarError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar): a 400."""


def _clean(exc: Exception) -> str:
    """xgrammar's message without its C++ timestamp and source location."""
    return _CPP_PREFIX.sub("", str(exc).strip())


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the given strings (JSON string escapes are valid
    EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs against one tokenizer. Thread-safe; built lazily because reading
    the vocabulary into xgrammar takes about half a second."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        from transformers import PreTrainedTokenizerFast

        xgr = _xgrammar()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        # NOTE: hearth keeps its own cache (keyed by spec and tokenizer), so xgrammar's
        # would only hold second copies.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.tokenizer_info = info
        """What a grammar compiled elsewhere (the compile child) is deserialized against."""

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind == "json":
                return c.compile_json_schema(
                    spec.value,
                    any_whitespace=spec.any_whitespace,
                    separators=spec.separators,
                    strict_mode=True,
                )
            if spec.kind == "json_object":
                # NOTE: xgrammar's builtin JSON grammar allows any value ([null] too);
                # OpenAI's json_object means an object.
                return c.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=spec.any_whitespace,
                    separators=spec.separators,
                )
            if spec.kind == "structural_tag":
                return c.compile_structural_tag(spec.value)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar(choice_grammar(json.loads(spec.value)))
            if spec.kind == "grammar":
                return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(_clean(exc)) from None
        raise GrammarError(f"unknown constraint kind {spec.kind!r}")


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar's end was reached and a stop token (EOS) accepted."""
        return bool(self.matcher.is_terminated())


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Mask, in place, the rows whose sequence is constrained; others stay untouched.

    A row that the mask would leave with no token at all (the grammar allows only EOS
    while min_tokens bans it, or only tokens `bad_words` bans) keeps the grammar's tokens
    instead: the constraint wins, since no other token could still match it.
    """
    # PERF: no gather/scatter of rows and no whole-batch checks: on a loaded CPU every
    # extra pass over [rows, vocab] costs as much as the masking itself.
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    import torch  # here, not at the top: the compile child (isolated.py) never needs it

    xgr = _xgrammar()
    num_rows, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)  # [num_rows, ceil(vocab/32)] int32
    for row in rows:
        grammar = requests[row].grammar
        assert grammar is not None
        grammar.matcher.fill_next_token_bitmask(bitmask, row)
    device_mask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, device_mask, indices=rows)
    for row in rows:
        request = requests[row]
        if (
            request.params.min_tokens <= request.num_output_tokens
            and not request.params.bad_words_token_ids
        ):
            continue  # nothing was banned besides the grammar: a token is always left
        if bool(torch.isneginf(logits[row]).all()):
            fallback = torch.zeros_like(logits[row : row + 1])
            xgr.apply_token_bitmask_inplace(fallback, device_mask[row : row + 1])
            logits[row] = fallback[0]
    return logits
