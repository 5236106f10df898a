"""Constrained decoding in the engine core, driven in-process (no transport).

One small core where prompts are prefilled in chunks (16-token budget) and the KV pool
(12 blocks of 16 tokens) is too small for the batch, so constrained sequences are
chunk-prefilled, preempted and recomputed while sharing steps with unconstrained ones.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams, StructuredOutputSpec
from engine.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
LONG_SYSTEM = "You are a careful assistant that always answers in the requested format."


@pytest.fixture(scope="module")
def tok(model_smollm2_dir: str) -> Tokenizer:
    return Tokenizer(model_smollm2_dir)


@pytest.fixture(scope="module")
def core(model_smollm2_dir: str):
    from engine.core import EngineCore

    return EngineCore(
        EngineConfig(
            model=model_smollm2_dir,
            num_kv_blocks=12,
            max_num_batched_tokens=16,
            max_num_seqs=8,
            num_threads=1,
            enable_prefix_caching=False,
        )
    )


def _prompt(tok: Tokenizer, text: str) -> list[int]:
    """The chat prompt, padded in the system turn to whole KV blocks, so that the very
    first generated token of each sequence needs a new block (preemption is certain)."""
    system = LONG_SYSTEM
    while True:
        chat = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        ids = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
        if len(ids) % 16 == 0:
            return ids
        system += " ok"


def _drive(core, requests: list[AddRequest]) -> dict[str, dict]:
    """Submit all, then step until every request finished; returns id -> result."""
    results: dict[str, dict] = {}
    for msg in requests:
        admission = core.add_request(msg)
        if admission is not None:
            assert admission.accepted, admission.message
    while core.has_work() or core.num_compiling:
        for _, admission in core.poll_compiled():
            results[admission.request_id] = {"admission": admission, "tokens": [], "lps": []}
        for _, out in core.step():
            r = results.setdefault(out.request_id, {"tokens": [], "lps": []})
            r["tokens"] += out.new_token_ids
            r["lps"] += out.new_logprobs or []
            if out.finish_reason:
                r["finish"] = out.finish_reason
    assert core.block_manager.num_used_blocks == 0
    return results


def _spec(kind: str, value: str = "", param: str = "structured_outputs") -> StructuredOutputSpec:
    return StructuredOutputSpec(kind=kind, value=value, param=param)


def _text(tok: Tokenizer, tokens: list[int]) -> str:
    return tok.decode(tokens, skip_special_tokens=True)


def test_mixed_batch_with_chunked_prefill_and_preemption(core, tok) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    free_prompt = _prompt(tok, "Name three colours.")
    alone = _drive(
        core, [AddRequest(request_id="alone", prompt_token_ids=free_prompt, params=plain)]
    )

    preemptions = core.scheduler.num_preemptions
    msgs = [AddRequest(request_id="free", prompt_token_ids=free_prompt, params=plain)]
    for i in range(2):  # n=2 of one request: two engine requests, two matchers
        msgs.append(
            AddRequest(
                request_id=f"json-{i}",
                prompt_token_ids=_prompt(tok, "Describe a person as JSON."),
                params=SamplingParams(
                    temperature=1.0,
                    seed=i,
                    max_tokens=40,
                    structured=_spec("json", json.dumps(PERSON)),
                ),
            )
        )
    msgs += [
        AddRequest(
            request_id="regex",
            prompt_token_ids=_prompt(tok, "Give a date."),
            params=SamplingParams(
                temperature=0.8,
                seed=7,
                max_tokens=20,
                structured=_spec("regex", r"\d{4}-\d{2}-\d{2}"),
            ),
        ),
        AddRequest(
            request_id="choice",
            prompt_token_ids=_prompt(tok, "Is the sky green?"),
            params=SamplingParams(
                temperature=0.0,
                max_tokens=10,
                min_tokens=8,
                logprobs=5,
                structured=_spec("choice", json.dumps(["yes", "no", "maybe not"])),
            ),
        ),
        AddRequest(
            request_id="grammar",
            prompt_token_ids=_prompt(tok, "Add two numbers."),
            params=SamplingParams(
                temperature=1.0,
                seed=3,
                max_tokens=30,
                structured=_spec("grammar", 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'),
            ),
        ),
    ]
    for msg in msgs:  # compiled ahead, so every request is admitted in the same step
        if msg.params.structured is not None:
            core.structured.compile(msg.params.structured)
    results = _drive(core, msgs)

    # Unconstrained greedy output is unchanged by sharing steps with masked rows.
    assert results["free"]["tokens"] == alone["alone"]["tokens"]
    for i in range(2):
        r = results[f"json-{i}"]
        assert r["finish"] == "stop"
        value = json.loads(_text(tok, r["tokens"]))
        assert set(value) == {"name", "age", "pets"}
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert all(p in ("cat", "dog") for p in value["pets"]) and len(value["pets"]) <= 3
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", _text(tok, results["regex"]["tokens"]))
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", _text(tok, results["grammar"]["tokens"]))
    # min_tokens cannot outlast a finished choice: the grammar allows nothing more.
    choice = results["choice"]
    assert _text(tok, choice["tokens"]) in ("yes", "no", "maybe not")
    assert choice["finish"] == "stop"
    # Logprobs are those of the masked distribution: every alternative reported is a
    # token the grammar allowed, and the sampled one carries (almost) all the mass.
    first = choice["lps"][0]
    for token_id, lp in first.top:
        if math.isfinite(lp):
            piece = _text(tok, [token_id])
            assert any(c.startswith(piece) for c in ("yes", "no", "maybe not")), piece
    assert core.scheduler.num_preemptions > preemptions, "the pool was meant to force preemption"


def test_max_tokens_cuts_a_constrained_output(core, tok) -> None:
    msg = AddRequest(
        request_id="short",
        prompt_token_ids=_prompt(tok, "Describe a person as JSON."),
        params=SamplingParams(
            temperature=0.0, max_tokens=3, structured=_spec("json", json.dumps(PERSON))
        ),
    )
    result = _drive(core, [msg])["short"]
    assert result["finish"] == "length" and len(result["tokens"]) == 3
    assert _text(tok, result["tokens"]).startswith("{")


def _person_as_json(tok: Tokenizer, request_id: str) -> AddRequest:
    """Six greedy tokens constrained to the PERSON schema."""
    return AddRequest(
        request_id=request_id,
        prompt_token_ids=_prompt(tok, "Describe a person as JSON."),
        params=SamplingParams(
            temperature=0.0, max_tokens=6, structured=_spec("json", json.dumps(PERSON))
        ),
    )


def test_a_token_the_grammar_rejects_ends_the_request_with_stop(core, tok, monkeypatch) -> None:
    """The sampler masks with the grammar, so a sampled token it then rejects means the
    mask and the matcher disagree: the request must end there with 'stop', not run on
    with a matcher that no longer follows the output."""
    from engine.structured.grammar import GrammarState

    rejected: list[int] = []

    def reject(self: GrammarState, token_id: int) -> bool:
        rejected.append(token_id)
        return False

    monkeypatch.setattr(GrammarState, "accept", reject)
    result = _drive(core, [_person_as_json(tok, "rejected")])["rejected"]
    assert result["finish"] == "stop"
    assert result["tokens"] == rejected[:1] and len(rejected) == 1


def test_a_grammar_that_raises_fails_its_request_alone(core, tok, monkeypatch) -> None:
    """An exception from the grammar library while it takes a sampled token (a bug there,
    not an input) ends that request with 'error' and the kind of failure; a plain request
    in the same steps runs to its length and the engine goes on (before, the exception
    left the step and stopped the engine: every request of every worker failed)."""
    from engine.structured.grammar import GrammarState

    def broken(self: GrammarState, token_id: int) -> bool:
        raise RuntimeError("matcher state corrupted")

    monkeypatch.setattr(GrammarState, "accept", broken)
    constrained = _person_as_json(tok, "broken")
    plain = AddRequest(
        request_id="plain",
        prompt_token_ids=_prompt(tok, "Name three colours."),
        params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    errors: dict[str, str | None] = {}
    original_step = core.step

    def step():
        outputs = original_step()
        errors.update((out.request_id, out.error) for _, out in outputs if out.finish_reason)
        return outputs

    monkeypatch.setattr(core, "step", step)
    results = _drive(core, [constrained, plain])
    assert results["broken"]["finish"] == "error" and len(results["broken"]["tokens"]) == 1
    assert errors["broken"] is not None and "RuntimeError" in errors["broken"]
    assert results["plain"]["finish"] == "length" and len(results["plain"]["tokens"]) == 4


@pytest.mark.parametrize(
    ("kind", "value", "needle"),
    [
        ("json", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}', "nope"),
        ("regex", "(abc", "parenthesis"),
        ("grammar", 'root ::= ("a"', "line 1"),
    ],
)
def test_bad_constraint_is_refused_with_its_field(core, tok, kind, value, needle) -> None:
    msg = AddRequest(
        request_id=f"bad-{kind}",
        prompt_token_ids=_prompt(tok, "hi"),
        params=SamplingParams(max_tokens=4, structured=_spec(kind, value, param="response_format")),
    )
    admission = _drive(core, [msg])[f"bad-{kind}"]["admission"]
    assert not admission.accepted and admission.error_kind == "invalid"
    assert admission.param == "response_format"
    assert needle in admission.message


def test_abort_while_compiling_admits_nothing(core, tok) -> None:
    spec = _spec("regex", r"[a-z]{3}-never-seen-before-\d+")
    msg = AddRequest(
        request_id="gone",
        prompt_token_ids=_prompt(tok, "hi"),
        params=SamplingParams(structured=spec),
    )
    assert core.add_request(msg) is None
    core.abort(["gone"])
    assert core.num_compiling == 0
    assert "gone" not in core.scheduler.requests


def test_a_dead_workers_compiling_requests_are_aborted_with_its_others(core, tok) -> None:
    """A worker that dies while one of its constrained requests is still compiling: the
    engine is told once (`abort_client`), so that request goes too; compiled later, it
    would have run to max_tokens for nobody. Another worker's compile is left alone."""
    for rid, client in (("orphan", b"dead"), ("kept", b"alive")):
        spec = _spec("regex", rf"[a-z]{{3}}-{rid}-never-seen-before-\d+")
        msg = AddRequest(
            request_id=rid,
            prompt_token_ids=_prompt(tok, "hi"),
            params=SamplingParams(structured=spec),
        )
        assert core.add_request(msg, client_id=client) is None
    assert core.abort_client(b"dead") == 1
    assert core.structured.is_pending("kept") and not core.structured.is_pending("orphan")
    core.abort(["kept"])
    assert core.num_compiling == 0
    assert not {"orphan", "kept"} & set(core.scheduler.requests)


def test_compiled_grammars_are_cached(core, monkeypatch) -> None:
    """Counts the compiles of this spec only: a compile an earlier test abandoned (the
    abort-while-compiling case) may still finish on the pool meanwhile."""
    spec = _spec("json", json.dumps({"type": "array", "items": {"type": "integer"}}))
    compiler = core.structured._get_compiler()
    real_compile = compiler.compile
    seen: list[StructuredOutputSpec] = []

    def counting_compile(s: StructuredOutputSpec):
        seen.append(s)
        return real_compile(s)

    monkeypatch.setattr(compiler, "compile", counting_compile)
    first = core.structured.compile(spec)
    assert core.structured.compile(spec) is first
    assert seen.count(spec) == 1


def test_compile_past_the_time_limit_is_refused(core, tok, monkeypatch) -> None:
    release = threading.Event()
    real_compile = core.structured.compile

    def stuck_compile(*args, **kwargs):
        release.wait(10)  # a pathological grammar, as far as the engine can tell
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(core.structured, "compile", stuck_compile)
    spec = _spec("regex", r"[0-9]{3}-timeout-[a-z]+", param="guided_regex")
    msg = AddRequest(
        request_id="slow",
        prompt_token_ids=_prompt(tok, "hi"),
        params=SamplingParams(structured=spec),
    )
    limit = core.structured.compile_timeout_s
    core.structured.compile_timeout_s = 0.0
    try:
        assert core.add_request(msg) is None
        answers: list = []
        for _ in range(500):  # until the compile thread has started (and overrun at once)
            answers = core.poll_compiled()
            if answers:
                break
            time.sleep(0.01)
        [(_, admission)] = answers
    finally:
        core.structured.compile_timeout_s = limit
        release.set()
    assert not admission.accepted and admission.param == "guided_regex"
    assert "took longer" in admission.message
    assert core.num_compiling == 0 and "slow" not in core.scheduler.requests


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TAG = {
    "type": "tag",
    "begin": "<function=get_weather>",
    "content": {"type": "json_schema", "json_schema": CITY},
    "end": "</function>",
}


def _accepts(core, spec: StructuredOutputSpec, text: str) -> bool:
    """Whether the compiled constraint accepts `text` as a complete output."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(core.structured.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


def test_structural_tag_constrains_only_the_tagged_spans(core) -> None:
    """Issue 9: vLLM's structural tag (the OpenAI-style structures and triggers, as the
    serving layer hands them over in xgrammar's format): text is free outside the tags,
    and each begin ... end span must be JSON matching its schema."""
    triggered = {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [WEATHER_TAG]},
    }
    spec = _spec("structural_tag", json.dumps(triggered), param="response_format")
    ok = 'Let me check. <function=get_weather>{"city": "Paris"}</function> Done.'
    assert _accepts(core, spec, ok)
    assert _accepts(core, spec, "No tool needed.")
    assert not _accepts(core, spec, '<function=get_weather>{"town": "Paris"}</function>')
    assert not _accepts(core, spec, '<function=get_weather>{"city": 5}</function>')
    assert not _accepts(core, spec, "<function=get_time>{}</function>")


def test_structural_tag_decode_obeys_the_schema_between_begin_and_end(core, tok) -> None:
    """A greedy decode under a tag format: the model must open the tag, fill it with
    JSON matching the schema, and close it."""
    spec = _spec(
        "structural_tag",
        json.dumps({"type": "structural_tag", "format": WEATHER_TAG}),
        param="response_format",
    )
    msg = AddRequest(
        request_id="tagged",
        prompt_token_ids=_prompt(tok, "What is the weather in Paris? Call get_weather."),
        params=SamplingParams(temperature=0.0, max_tokens=60, structured=spec),
    )
    result = _drive(core, [msg])["tagged"]
    text = _text(tok, result["tokens"])
    assert result["finish"] == "stop", text
    match = re.fullmatch(r"<function=get_weather>(.*)</function>", text, re.DOTALL)
    assert match, text
    value = json.loads(match.group(1))
    assert set(value) == {"city"} and isinstance(value["city"], str) and len(value["city"]) <= 16


def test_bad_structural_tag_is_refused_with_its_field(core, tok) -> None:
    bad = {"type": "structural_tag", "format": {"type": "no_such_format"}}
    msg = AddRequest(
        request_id="bad-tag",
        prompt_token_ids=_prompt(tok, "hi"),
        params=SamplingParams(
            max_tokens=4,
            structured=_spec("structural_tag", json.dumps(bad), param="response_format"),
        ),
    )
    admission = _drive(core, [msg])["bad-tag"]["admission"]
    assert not admission.accepted and admission.error_kind == "invalid"
    assert admission.param == "response_format"


@pytest.mark.parametrize(
    ("any_whitespace", "separators", "accepted", "refused"),
    [
        (False, (",", ":"), '{"city":"Paris"}', '{"city": "Paris"}'),
        (False, None, '{"city": "Paris"}', '{"city":"Paris"}'),
        (True, None, '{\n  "city" :  "Paris"\n}', '{"city": 5}'),
    ],
)
def test_json_layout_follows_the_whitespace_options(
    core, any_whitespace, separators, accepted, refused
) -> None:
    """whitespace_pattern's mapping ("" / "[ ]?" / "\\s*", handlers/protocol/structured.py)
    holds for xgrammar's layout options."""
    spec = StructuredOutputSpec(
        kind="json", value=json.dumps(CITY), any_whitespace=any_whitespace, separators=separators
    )
    assert _accepts(core, spec, accepted)
    assert not _accepts(core, spec, refused)


class _QueuedTransport:
    """The engine loop's transport, fed from a list: the first poll hands over every
    queued message, later polls wait their timeout and return nothing."""

    def __init__(self, messages: list) -> None:
        self.messages = [(b"w", m) for m in messages]
        self.sent: list = []

    def poll(self, timeout_ms: int) -> list:
        batch, self.messages = self.messages, []
        if not batch:
            time.sleep(timeout_ms / 1000)
        return batch

    def send(self, client_id: bytes, message) -> None:
        self.sent.append(message)

    def take_gone_clients(self) -> set[bytes]:
        return set()


def test_the_grammar_library_loads_only_once_the_engine_is_idle(core, tok, monkeypatch) -> None:
    """Loading xgrammar (and transformers) holds the GIL for ~2 s; done at ready, it made
    the first request after start-up take 2.2 s instead of 0.4 s. The loop now starts it
    once, after PREWARM_AFTER_IDLE_S with nothing to do, never while a step is running."""
    from engine import core_loop

    prewarms: list[float] = []
    steps: list[tuple[float, float]] = []
    real_step = core.step

    def timed_step():
        start = time.monotonic()
        try:
            return real_step()
        finally:
            steps.append((start, time.monotonic()))

    monkeypatch.setattr(core_loop, "PREWARM_AFTER_IDLE_S", 0.5)
    monkeypatch.setattr(core.structured, "prewarm", lambda: prewarms.append(time.monotonic()))
    monkeypatch.setattr(core, "step", timed_step)
    msg = AddRequest(
        request_id="busy",
        prompt_token_ids=_prompt(tok, "hi"),
        params=SamplingParams(max_tokens=24, ignore_eos=True),
    )
    transport = _QueuedTransport([msg])
    stop = threading.Event()
    loop = threading.Thread(
        target=core_loop.run_engine_loop, args=(core, transport, stop, False), daemon=True
    )
    loop.start()
    try:
        deadline = time.monotonic() + 120
        while not prewarms and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a second idle stretch: still no second load
    finally:
        stop.set()
        loop.join(30)
    assert not loop.is_alive()
    assert len(prewarms) == 1, prewarms
    assert steps, "the request ran"
    assert prewarms[0] >= steps[-1][1] + 0.5, "loaded during or right after the work"
