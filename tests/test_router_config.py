"""RouterConfig: one frozen config from flags, with SPECDEC_ROUTER_* environment fallbacks, validated by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import RouterConfig
from router.requests import DraftShape, GenerateInput, plan_request
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
        ({"tree_width": 0}, "tree_width"),
        ({"tree_width": 2, "tree_budget": 9}, "tree_budget"),
    ],
)
def test_validation_names_the_field(fields: dict, name: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        RouterConfig(**{"model": "m", "verifiers": ("v:1",), **fields})
    assert raised.value.field == name


def test_tree_shape_flags() -> None:
    config = RouterConfig.from_args(
        ["--model", "m", "--verifier", "v:1", "--tree-width", "2", "--tree-budget", "5"], {}
    )
    assert (config.num_draft_tokens, config.tree_width, config.tree_budget) == (4, 2, 5)
    environ = {"SPECDEC_ROUTER_TREE_WIDTH": "3", "SPECDEC_ROUTER_TREE_BUDGET": "4"}
    config = RouterConfig.from_args(["--model", "m", "--verifier", "v:1"], environ)
    assert (config.tree_width, config.tree_budget) == (3, 4)


@pytest.mark.parametrize(
    ("asked", "shape"),
    [
        ({}, DraftShape(3, 2, 4)),  # the server's shape
        ({"num_draft_tokens": 1}, DraftShape(1, 2, 2)),  # the server's budget, capped at what depth 1 holds
        ({"tree_budget": 6}, DraftShape(3, 2, 6)),  # the server's width, the request's budget
        ({"tree_width": 1}, DraftShape(3, 1, 0)),  # a chain as deep as the server's trees
        ({"tree_width": 3, "tree_budget": 5}, DraftShape(3, 3, 5)),
        ({"tree_width": 3}, DraftShape(3, 3, 0)),  # a width of its own: its own budget (0: the width a level)
    ],
)
def test_a_request_takes_the_servers_shape_where_it_names_none(asked: dict, shape: DraftShape) -> None:
    config = RouterConfig(model="m", verifiers=("v:1",), num_draft_tokens=3, tree_width=2, tree_budget=4)
    assert plan_request(GenerateInput(prompt_ids=(1, 2, 3), **asked), config, None, ()).shape == shape


@pytest.mark.parametrize(
    ("asked", "shape"),
    [
        ({"temperature": 0.0}, DraftShape(4, 3, 4)),  # greedy: the 4 most probable nodes of a tree 4 deep
        ({}, DraftShape(4)),  # sampled, it spends its 4 nodes a level each: the chain of 4
        ({"temperature": 0.7, "tree_budget": 3}, DraftShape(3)),
        ({"temperature": 0.7, "num_draft_tokens": 3}, DraftShape(3)),  # 3 nodes in 3 levels
        ({"temperature": 0.7, "tree_budget": 6}, DraftShape(4, 3, 6)),  # 6 nodes in 4 levels: a tree
        ({"temperature": 0.7, "tree_width": 2, "tree_budget": 6}, DraftShape(4, 2, 6)),
    ],
)
def test_the_default_shape_is_a_greedy_tree_and_a_sampled_chain(asked: dict, shape: DraftShape) -> None:
    config = RouterConfig(model="m", verifiers=("v:1",))
    assert plan_request(GenerateInput(prompt_ids=(1, 2, 3), **asked), config, None, ()).shape == shape


@pytest.mark.parametrize(
    ("server", "shape"),
    [
        ({"num_draft_tokens": 8, "tree_width": 1}, DraftShape(8)),  # a chain of the server's depth, not of 4 nodes
        ({"num_draft_tokens": 2, "tree_width": 1}, DraftShape(2)),
        ({"num_draft_tokens": 6}, DraftShape(6, 3, 6)),  # as many nodes as levels
        ({"num_draft_tokens": 6, "tree_budget": 0}, DraftShape(6, 3, 0)),  # the width a level
    ],
)
def test_a_server_shape_without_a_budget_verifies_as_many_nodes_as_levels(server: dict, shape: DraftShape) -> None:
    config = RouterConfig(model="m", verifiers=("v:1",), **server)
    assert plan_request(GenerateInput(prompt_ids=(1, 2, 3), temperature=0.0), config, None, ()).shape == shape
