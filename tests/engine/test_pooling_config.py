"""Reading a model directory's embedding recipe (engine/pooling_config.py): the
sentence-transformers files in their current and older forms, what is refused and why,
and the Matryoshka rules for `dimensions`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.pooling_config import PoolingConfig, read_pooling_config

TRANSFORMER = {"path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def write(directory: Path, modules: list[dict] | None, pooling: Any = None, **config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    if modules is not None:
        (directory / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return directory


def test_no_pipeline_is_last_token_normalised(tmp_path: Path) -> None:
    config = read_pooling_config(write(tmp_path, None))
    assert (config.method, config.normalize, config.hidden_size) == ("last", True, 64)
    assert config.unsupported is None and not config.matryoshka


@pytest.mark.parametrize(
    ("pooling", "method"),
    [
        ({"pooling_mode": "mean"}, "mean"),
        ({"pooling_mode": "cls"}, "cls"),
        ({"pooling_mode": ["lasttoken"]}, "last"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"pooling_mode_cls_token": True}, "cls"),
        ({"word_embedding_dimension": 64}, "mean"),  # sentence-transformers' default mode
    ],
)
def test_sentence_transformers_modes(tmp_path: Path, pooling: dict, method: str) -> None:
    config = read_pooling_config(write(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], pooling))
    assert (config.method, config.normalize, config.unsupported) == (method, True, None)
    assert "modules.json" in config.source


def test_without_normalize_nothing_is_normalised(tmp_path: Path) -> None:
    config = read_pooling_config(write(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode": "cls"}))
    assert (config.method, config.normalize) == ("cls", False)


@pytest.mark.parametrize(
    ("modules", "pooling", "why"),
    [
        ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, "'max'"),
        ([TRANSFORMER, POOLING], {"pooling_mode": ["mean", "cls"]}, "['mean', 'cls']"),
        (
            [TRANSFORMER, POOLING],
            {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
            "pooling mode",
        ),
        ([TRANSFORMER, POOLING, DENSE, NORMALIZE], {"pooling_mode": "mean"}, "Dense"),
        ([TRANSFORMER], None, "Transformer -> Pooling"),
    ],
)
def test_what_hearth_does_not_run_is_refused_with_its_reason(
    tmp_path: Path, modules: list[dict], pooling: Any, why: str
) -> None:
    config = read_pooling_config(write(tmp_path, modules, pooling))
    assert config.unsupported is not None and why in config.unsupported


def test_matryoshka_rules(tmp_path: Path) -> None:
    plain = PoolingConfig(hidden_size=64)
    assert plain.check_dimensions(None) is None
    assert "Matryoshka" in (plain.check_dimensions(32) or "")
    assert "at least 1" in (plain.check_dimensions(0) or "")
    any_size = read_pooling_config(write(tmp_path / "a", None, is_matryoshka=True))
    assert any_size.matryoshka and any_size.check_dimensions(7) is None
    assert "at most" in (any_size.check_dimensions(65) or "")
    listed = read_pooling_config(write(tmp_path / "b", None, matryoshka_dimensions=[16, 32]))
    assert listed.matryoshka and listed.check_dimensions(32) is None
    assert "[16, 32]" in (listed.check_dimensions(8) or "")
