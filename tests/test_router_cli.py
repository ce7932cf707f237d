"""``specdec generate --router HOST:PORT``: the SDK path of the CLI prints the same ``--json`` object as the
co-located path (plus the pipeline counters), and bad input or an unreachable router is one clear line."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from specdec.cli import main
from specdec.model_files import load_tokenizer
from tests.test_router_grpc import Stack
from tests.tiny_models import SMOLLM2

SENTENCE = "The quick brown fox jumps over the lazy dog."
JSON_STATS = {
    "rounds": int,
    "draft_tokens": int,
    "accepted_tokens": int,
    "mean_accepted_length": float,
    "accepted_per_position": list,
    "draft_s": float,
    "verify_s": float,
    "state_s": float,
    "tokens_per_s": float,
    "pipeline_hits": int,
    "pipeline_misses": int,
    "wire_bytes": int,
    "drafter_fallback": bool,
}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tokenizer = load_tokenizer(SMOLLM2)
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    stack = Stack(tokenizer=tokenizer, next_token=lambda context: ids[len(context) % len(ids)], model=SMOLLM2)
    stack.tokenizer = tokenizer
    stack.sentence_ids = ids
    yield stack
    stack.stop()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["generate", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_json_through_the_router(stack: Stack, capsys) -> None:
    status, out, err = run(capsys, "Hello", "--router", stack.router.grpc_address, "--max-tokens", "12", "--json")
    assert status == 0, err
    [line] = out.splitlines()
    result = json.loads(line)
    prompt_ids = stack.tokenizer.encode("Hello", add_special_tokens=False)
    expected = [stack.sentence_ids[(len(prompt_ids) + i) % len(stack.sentence_ids)] for i in range(12)]
    assert result["token_ids"] == expected
    assert result["text"] == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12}
    for key, kind in JSON_STATS.items():
        assert isinstance(result["stats"][key], kind), key
    stats = result["stats"]
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["rounds"])


def test_text_and_stop_through_the_router(stack: Stack, capsys) -> None:
    argv = ["Hi", "--router", stack.router.grpc_address, "--max-tokens", "30", "--stop", "lazy", "--chat"]
    pipelined_before = stack.drafter.log.count("propose-assume")
    status, out, err = run(capsys, *argv, "--speculation", "sequential", "--drafter", "ngram")
    assert status == 0, err
    assert out.endswith("\n") and "lazy" not in out and "brown fox" in out
    assert err.strip().splitlines()[-1].startswith("[stop] ")
    assert stack.drafter.log.count("propose-assume") == pipelined_before  # --speculation sequential reached it


@pytest.mark.parametrize(
    ("flags", "field"), [(["--top-k", "-1"], "top_k"), (["--drafter", "model"], "drafter")], ids=["local", "router"]
)
def test_bad_input_is_one_line(stack: Stack, capsys, flags: list[str], field: str) -> None:
    """Checked before sending (top_k) or refused by the router (no model drafter is served): status 2, one line."""
    status, out, err = run(capsys, "Hi", "--router", stack.router.grpc_address, *flags)
    assert status == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("specdec: error: ") and field in line


def test_stop_needs_the_router(capsys) -> None:
    status, out, err = run(capsys, "Hi", "--stop", "x")
    assert status == 2 and "stop" in err and out == ""


def test_unreachable_router(capsys) -> None:
    status, out, err = run(capsys, "Hi", "--router", "127.0.0.1:1", "--timeout", "2")
    assert status == 1 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("specdec: error: router 127.0.0.1:1: UNAVAILABLE")
