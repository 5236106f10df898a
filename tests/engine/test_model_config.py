"""engine.model_config reads a plain Llama config.json without transformers: every value
the native model reads must be what transformers' AutoConfig gives, and every config it
cannot read exactly must go to AutoConfig."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, PretrainedConfig

from engine.model_config import read_model_config
from engine.models.llama import rope_config

READ = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "vocab_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "head_dim",
)
"""What the native model and the engine read with plain attribute access."""
OPTIONAL = ("attention_bias", "mlp_bias", "hidden_act", "partial_rotary_factor", "sliding_window")
"""What they read with getattr and a default."""


def facts(config: Any) -> dict[str, Any]:
    out = {name: getattr(config, name) for name in READ}
    defaults = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    for name in OPTIONAL:
        out[name] = getattr(config, name, defaults.get(name))
    out["rope"] = rope_config(config)
    return out


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def smollm2_config(model_smollm2_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_smollm2_dir) / "config.json").read_text())


def test_the_default_model_is_read_without_transformers(model_smollm2_dir: str) -> None:
    config = read_model_config(model_smollm2_dir)
    assert not isinstance(config, PretrainedConfig)
    expected = AutoConfig.from_pretrained(model_smollm2_dir, local_files_only=True)
    assert facts(config) == facts(expected)
    # ... and the engine process really skips the import (it costs ~1.5 s of start-up).
    code = (
        "import sys; from engine.model_config import read_model_config; "
        f"read_model_config({model_smollm2_dir!r}); print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    return config


def without(name: str):
    return lambda config: {k: v for k, v in config.items() if k != name}


def with_(**changes: Any):
    return lambda config: {**config, **changes}


@pytest.mark.parametrize(
    "change",
    [legacy_rope, without("head_dim"), with_(tie_word_embeddings=False, attention_bias=True)],
    ids=["rope-theta-spelling", "no-head-dim", "untied-with-bias"],
)
def test_other_plain_llama_configs_read_the_same(
    tmp_path: Path, smollm2_config: dict[str, Any], change
) -> None:
    path = write(tmp_path, change(smollm2_config))
    config = read_model_config(path)
    assert not isinstance(config, PretrainedConfig)
    assert facts(config) == facts(AutoConfig.from_pretrained(path, local_files_only=True))


@pytest.mark.parametrize(
    "change",
    [
        without("num_key_value_heads"),  # LlamaConfig's default: as many as query heads
        without("max_position_embeddings"),
        without("tie_word_embeddings"),
        without("rms_norm_eps"),
        without("rope_parameters"),
        with_(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        with_(rope_scaling={"type": "dynamic", "factor": 2.0}),
        with_(model_type="mistral", architectures=["MistralForCausalLM"]),  # sliding window
    ],
    ids=[
        "no-kv-heads",
        "no-max-positions",
        "no-tie",
        "no-eps",
        "no-rope",
        "rope-scaling",
        "legacy-rope-scaling",
        "mistral",
    ],
)
def test_anything_else_goes_to_transformers(
    tmp_path: Path, smollm2_config: dict[str, Any], change
) -> None:
    path = write(tmp_path, change(smollm2_config))
    config = read_model_config(path)
    assert isinstance(config, PretrainedConfig)
    assert facts(config) == facts(AutoConfig.from_pretrained(path, local_files_only=True))


def test_a_config_transformers_refuses_is_still_refused(
    tmp_path: Path, smollm2_config: dict[str, Any]
) -> None:
    path = write(tmp_path, {**smollm2_config, "num_attention_heads": 7})  # 576 % 7 != 0
    with pytest.raises(Exception, match="multiple of the number of attention"):
        read_model_config(path)


def test_a_missing_config_is_transformers_error(tmp_path: Path, model_smollm2_dir: str) -> None:
    shutil.copy(Path(model_smollm2_dir) / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"config\.json"):
        read_model_config(tmp_path)
