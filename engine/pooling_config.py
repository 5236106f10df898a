"""How the served model turns hidden states into one embedding, read from its directory.

The engine reads this once at start-up (it pools) and hands it to the workers in
`ModelInfo.pooling` (they check `dimensions` against it), so both sides follow one
reading of the files. The rules, in order (docs/api.md, "Embeddings"):

1. A sentence-transformers pipeline (`modules.json`): its `Pooling` module's mode (the
   `pooling_mode` key of sentence-transformers 5+, or the older `pooling_mode_*`
   booleans) and whether a `Normalize` module follows. Supported modes are `lasttoken`,
   `mean` and `cls`; a pipeline with another mode, several modes at once or another
   module (`Dense`, ...) serves no embeddings, and the reason is the 400's message.
2. No pipeline: last-token pooling, normalised, which is how causal-LM embedders (e5-
   mistral, gte-Qwen, Qwen3-Embedding) are used, and vLLM's default for them.

A sequence classifier (`config.json` names a `*ForSequenceClassification` architecture:
engine/models/classifier.py) pools the last token and runs its head on it: its
`ClassifierConfig` (labels, activation) replaces the embedding recipe, and it serves
classification and cross-encoder scores, not embeddings.

Matryoshka truncation (`dimensions`) follows vLLM: allowed when `config.json` has
`is_matryoshka: true` (any size up to the hidden size) or `matryoshka_dimensions` (only
those sizes).

Worker-side (no torch): plain JSON reading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

POOLING_METHODS = ("last", "mean", "cls")

_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_TRANSFORMER = "Transformer"
_ST_POOLING = "Pooling"
_ST_NORMALIZE = "Normalize"


CLASSIFIER_SUFFIX = "ForSequenceClassification"

ACTIVATIONS = ("classify", "sigmoid", "identity")
"""How a classifier's logits become its answer: "classify" (softmax over two or more
labels, sigmoid for one), "sigmoid" (each label on its own: multi-label) or "identity"
(regression, or a cross-encoder trained without one)."""


class ClassifierConfig(msgspec.Struct, kw_only=True, frozen=True):
    """A sequence classifier's head, as its config.json describes it."""

    num_labels: int
    labels: list[str | None]
    """Each label's name (`id2label`), by index; None where the config names none."""
    activation: str = "classify"
    """One of ACTIVATIONS, read as vLLM reads it (`problem_type`, then
    sentence-transformers' cross-encoder `activation_fn`)."""


class PoolingConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The served model's embedding recipe (one per engine)."""

    method: str = "last"
    """'last' (the last prompt token's hidden state), 'mean' (over all prompt tokens) or
    'cls' (the first token's)."""
    normalize: bool = True
    """Scale the vector to unit L2 norm (after any `dimensions` truncation)."""
    hidden_size: int = 0
    """Length of the full embedding (the model's hidden size)."""
    matryoshka: bool = False
    """`dimensions` may truncate the embedding (Matryoshka representation learning)."""
    matryoshka_dimensions: list[int] | None = None
    """The only sizes `dimensions` may take, when the model lists them."""
    source: str = "default: last-token pooling, normalised (no sentence-transformers config)"
    """Where the recipe came from (the start-up log line)."""
    unsupported: str | None = None
    """Why this model serves no embeddings (None: it does)."""
    classifier: ClassifierConfig | None = None
    """Set for a sequence classifier: its pooled rows go through its head."""
    prompts: dict[str, str] | None = None
    """Task prefixes by name (sentence-transformers' `prompts` in
    config_sentence_transformers.json, or config.json's `task_instructions`), which
    Cohere's embed API selects with `input_type`; None: the model defines none."""

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """The 400 message for a `dimensions` this model cannot give (None: fine)."""
        if dimensions is None:
            return None
        if dimensions < 1:
            return "dimensions must be at least 1"
        if not self.matryoshka:
            return (
                "this model does not support Matryoshka representations, so dimensions "
                "cannot change the embedding size"
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            return f"this model supports only these dimensions: {sorted(allowed)}"
        if dimensions > self.hidden_size:
            return f"dimensions must be at most the embedding size, {self.hidden_size}"
        return None


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The recipe of the model in `model_dir` (see the module docstring)."""
    directory = Path(model_dir)
    config = _read_json(directory / "config.json")
    config = config if isinstance(config, dict) else {}
    hidden_size = _int_or(config.get("hidden_size"), 0)
    matryoshka_dims = config.get("matryoshka_dimensions")
    dims = (
        [int(d) for d in matryoshka_dims if isinstance(d, int)]
        if isinstance(matryoshka_dims, list)
        else None
    )
    common: dict[str, Any] = {
        "hidden_size": hidden_size,
        "matryoshka": bool(config.get("is_matryoshka")) or bool(dims),
        "matryoshka_dimensions": dims or None,
        "prompts": _prompts(directory, config),
    }
    classifier = _classifier(config)
    if classifier is not None:
        return PoolingConfig(
            **common,
            normalize=False,
            classifier=classifier,
            source=(
                f"sequence classifier ({classifier.num_labels} labels, "
                f"{classifier.activation}): last-token pooling, then its score head"
            ),
            unsupported=(
                "this model is a sequence classifier: it serves /classify, /score and "
                "/rerank, not embeddings"
            ),
        )
    modules = _read_json(directory / "modules.json")
    if not isinstance(modules, list):
        return PoolingConfig(**common)
    return _from_pipeline(directory, modules, common)


def _prompts(directory: Path, config: dict[str, Any]) -> dict[str, str] | None:
    """The model's named task prefixes (vLLM reads the same two places)."""
    st = _read_json(directory / "config_sentence_transformers.json")
    for source in (
        config.get("task_instructions"),
        st.get("prompts") if isinstance(st, dict) else None,
    ):
        if isinstance(source, dict):
            prompts = {k: v for k, v in source.items() if isinstance(k, str) and isinstance(v, str)}
            if prompts:
                return prompts
    return None


def _classifier(config: dict[str, Any]) -> ClassifierConfig | None:
    architectures = config.get("architectures")
    if not (
        isinstance(architectures, list)
        and architectures
        and isinstance(architectures[0], str)
        and architectures[0].endswith(CLASSIFIER_SUFFIX)
    ):
        return None
    id2label = config.get("id2label")
    names = id2label if isinstance(id2label, dict) else {}
    num_labels = _int_or(config.get("num_labels"), len(names) or 2)
    labels = [names.get(str(i)) if isinstance(names.get(str(i)), str) else None
              for i in range(num_labels)]  # fmt: skip
    return ClassifierConfig(num_labels=num_labels, labels=labels, activation=_activation(config))


def _activation(config: dict[str, Any]) -> str:
    """vLLM's reading (`get_act_fn`): `problem_type` first, then a sentence-transformers
    cross-encoder's `activation_fn`, else classify."""
    problem = config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem == "single_label_classification":
        return "classify"
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    if name is None:
        name = config.get("sbert_ce_default_activation_function")
    if isinstance(name, str) and name.rsplit(".", 1)[-1] == "Identity":
        return "identity"
    return "classify"


def _from_pipeline(directory: Path, modules: list[Any], common: dict[str, Any]) -> PoolingConfig:
    kinds = []
    pooling_path = None
    for entry in modules:
        kind = str(entry.get("type", "")) if isinstance(entry, dict) else ""
        short = kind.rsplit(".", 1)[-1]
        kinds.append(short)
        if short == _ST_POOLING:
            pooling_path = str(entry.get("path", ""))
    source = "sentence-transformers modules.json: " + " -> ".join(kinds)
    allowed = [_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE]
    extra = [k for k in kinds if k not in allowed]
    if extra or kinds[:2] != [_ST_TRANSFORMER, _ST_POOLING] or len(kinds) > 3:
        return PoolingConfig(
            **common,
            source=source,
            unsupported=(
                "this model's sentence-transformers pipeline "
                f"({' -> '.join(kinds) or 'empty'}) is not one hearth runs: "
                "Transformer -> Pooling, optionally -> Normalize"
            ),
        )
    assert pooling_path is not None
    pooling = _read_json(directory / pooling_path / "config.json")
    mode = _pooling_mode(pooling if isinstance(pooling, dict) else {})
    method = _ST_MODES.get(mode) if isinstance(mode, str) else None
    if method is None:
        return PoolingConfig(
            **common,
            source=source,
            unsupported=(
                f"this model's pooling mode {mode!r} is not supported "
                "(supported: lasttoken, mean, cls)"
            ),
        )
    return PoolingConfig(
        **common,
        method=method,
        normalize=kinds[-1] == _ST_NORMALIZE,
        source=f"{source} ({mode} pooling)",
    )


def _pooling_mode(config: dict[str, Any]) -> Any:
    """sentence-transformers 5+ `pooling_mode` (a name or a list of names), or the older
    `pooling_mode_*` booleans; several modes come back as a list (unsupported)."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        if isinstance(mode, list) and len(mode) == 1:
            return mode[0]
        return mode
    active = [mode for key, mode in _ST_LEGACY_MODES.items() if config.get(key)]
    if not active:
        return "mean"  # sentence-transformers' own default
    return active[0] if len(active) == 1 else active


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
