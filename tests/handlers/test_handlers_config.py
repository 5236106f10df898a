"""ServerConfig: the JSON environment transport from the CLI to the workers."""

from __future__ import annotations

import pytest

from handlers.config import ENV_VAR, ServerConfig, digest_api_key


def test_round_trip_through_the_environment() -> None:
    config = ServerConfig.with_api_keys(
        ["k1", "k2"],
        model_dir="/models/x",
        served_model_names=["a", "b"],
        allowed_origins=["https://x.example"],
        sse_keep_alive_interval=2.5,
        max_log_len=100,
    )
    env = config.to_env()
    assert list(env) == [ENV_VAR]
    rebuilt = ServerConfig.from_env(env)
    assert rebuilt == config
    assert rebuilt.served_model_names == ("a", "b")
    assert rebuilt.api_key_digests == (digest_api_key("k1"), digest_api_key("k2"))
    assert "k1" not in env[ENV_VAR]  # only digests travel


def test_defaults() -> None:
    config = ServerConfig.from_env({})
    assert config.served_model_names == ("default",)
    assert config.max_request_body_bytes == 6 * 1024 * 1024
    assert config.allowed_origins == () and config.api_key_digests == ()
    assert ServerConfig(model_dir="/m/llama").default_model_name == "/m/llama"


def test_the_metrics_label_is_a_defaulted_paths_last_part_only() -> None:
    """Issue 17, item 9: a served name defaulted from the model's path labels the
    /metrics series by its last part; a name the user gave labels them as given."""
    assert ServerConfig(model_dir="/srv/models/llama-3/").metrics_label == "llama-3"
    assert ServerConfig(model_dir="/m/x", served_model_names=["org/m"]).metrics_label == "org/m"
    named = ServerConfig(served_model_names=["/srv/m"], metrics_model_name="m")
    assert named.default_model_name == "/srv/m" and named.metrics_label == "m"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("not json", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"no_such_setting": 1}', "no_such_setting"),
        ('{"max_n": "16"}', "max_n"),
        ('{"served_model_names": "one"}', "served_model_names"),
        ('{"api_key_digests": ["plain-key"]}', "api_key_digests"),
        ('{"sse_keep_alive_interval": 0}', "sse_keep_alive_interval"),
        ('{"request_timeout": -1}', "request_timeout"),
        ('{"generation_config": "maybe"}', "generation_config"),
        ('{"root_path": "api"}', "root_path"),
    ],
)
def test_bad_values_fail_loudly_naming_the_setting(value: str, named: str) -> None:
    with pytest.raises(ValueError, match=named) as failure:
        ServerConfig.from_env({ENV_VAR: value})
    assert ENV_VAR in str(failure.value) or "ServerConfig." in str(failure.value)


def test_config_is_immutable() -> None:
    config = ServerConfig(served_model_names=["a"])
    with pytest.raises(AttributeError):
        config.max_n = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop"),
        ("/invocations", {"inputs": "hi", "parameters": {"stop": ["a", "b", "c"]}}, None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs"),
    ],
)
def test_the_configured_limits_bound_every_api(make_client, path, body, param) -> None:
    """--max-n, --max-stop-strings and --max-logprobs reach request validation (TGI's
    stop list included); the same bodies pass under the defaults."""
    tight = make_client(max_n=2, max_stop_strings=2, max_logprobs=2)
    result = tight.simulate_post(path, json=body)
    assert result.status_code == 400, result.text
    if param is not None:
        assert result.json["error"]["param"] == param
    assert make_client().simulate_post(path, json=body).status_code == 200


@pytest.mark.parametrize("field", ["max_n", "max_stop_strings", "max_request_body_bytes"])
def test_a_limit_below_its_minimum_is_refused_naming_it(field: str) -> None:
    with pytest.raises(ValueError, match=f"ServerConfig.{field} must be at least 1"):
        ServerConfig(**{field: 0})
