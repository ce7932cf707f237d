"""RouterConfig: one frozen config from flags, with SPECDEC_ROUTER_* environment fallbacks, validated by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import RouterConfig
from specdec.errors import InvalidArgumentError


def test_flags() -> None:
    argv = "--model m --verifier v:1 --verifier v:2 --drafter d:1 --default-speculation sequential --grpc-port 0"
    argv += " --max-concurrent-requests 3 --drafter-deadline-s 0.5 --eos-token-id 7"
    config = RouterConfig.from_args(argv.split(), {})
    assert (config.model, config.tokenizer) == ("m", "m")
    assert (config.verifiers, config.drafters) == (("v:1", "v:2"), ("d:1",))
    assert config.default_speculation == "sequential" and config.grpc_port == 0 and config.max_concurrent_requests == 3
    assert config.drafter_deadline_s == 0.5 and config.eos_token_ids == (7,) and config.bearer_token is None


def test_environment_fallbacks_and_flags_win(tmp_path: Path) -> None:
    environ = {
        "SPECDEC_ROUTER_MODEL": "m",
        "SPECDEC_ROUTER_VERIFIERS": "v:1, v:2",
        "SPECDEC_ROUTER_DRAFTERS": "d:1",
        "SPECDEC_ROUTER_DEFAULT_SPECULATION": "pipelined",
        "SPECDEC_ROUTER_HTTP_PORT": "9000",
        "SPECDEC_ROUTER_NO_TOKENIZER": "1",
        "SPECDEC_ROUTER_BEARER_TOKEN": "from-env",
    }
    config = RouterConfig.from_args([], environ)
    assert config.verifiers == ("v:1", "v:2") and config.drafters == ("d:1",)
    assert config.default_speculation == "pipelined"
    assert config.http_port == 9000 and config.tokenizer is None and config.bearer_token == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    config = RouterConfig.from_args(
        ["--verifier", "x:1", "--http-port", "1", "--bearer-token-file", str(token_file)], environ
    )
    assert config.verifiers == ("x:1",) and config.http_port == 1 and config.bearer_token == "from-file"


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"verifiers": ()}, "verifiers"),
        ({"default_drafter": "magic"}, "default_drafter"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"num_draft_tokens": 40}, "num_draft_tokens"),
        ({"verifier_deadline_s": 0.0}, "verifier_deadline_s"),
        ({"bearer_token": ""}, "bearer_token"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"default_speculation": "off"}, "default_speculation"),
    ],
)
def test_validation_names_the_field(fields: dict, name: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        RouterConfig(**{"model": "m", "verifiers": ("v:1",), **fields})
    assert raised.value.field == name
