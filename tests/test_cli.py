"""``specdec generate``: bad input gets one clear line on stderr naming the field and exit status 2, never a
traceback (DESIGN §9); the happy path prints the ``--json`` object with the speculation counters (DESIGN §7).

Most cases call :func:`specdec.cli.main` in-process; one runs ``python -m specdec.cli`` in a subprocess to
see what a user sees. Cases that need the real SmolLM2 target get the process-wide cached copy
(:func:`tests.tiny_models.smollm2`) in place of a fresh ``load_model("smollm2-135m")``, which would
dequantise the GGUF again for every call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import specdec.models
from specdec.cli import encode_prompt, main
from specdec.distill.command import resample_id, sampling_for
from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
from specdec.engine import Engine, GenerationRequest
from specdec.models import load_model
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from tests.tiny_models import SMOLLM2, smollm2, tiny_llama

REPO = Path(__file__).resolve().parents[1]
ERROR_PREFIX = "specdec: error: "


@pytest.fixture
def cached_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """``specdec generate`` gets the cached SmolLM2 for its default target; other names load as usual."""

    def load(name: str, **kwargs):
        default = kwargs.get("dtype", torch.float32) == torch.float32 and str(kwargs.get("device", "cpu")) == "cpu"
        return smollm2() if name == SMOLLM2 and default else load_model(name, **kwargs)

    monkeypatch.setattr(specdec.models, "load_model", load)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (vocabulary 16, no tokenizer) saved with ``save_pretrained``."""
    directory = tmp_path_factory.mktemp("tiny-llama-vocab16")
    tiny_llama(seed=3, vocab_size=16).model.save_pretrained(directory)
    return directory


def error_line(stderr: str) -> str:
    """The one error line; it must also be the last line (a message that runs on is not one line)."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, f"expected one {ERROR_PREFIX!r} line, stderr was:\n{stderr}"
    assert lines[-1] == errors[0], f"the error message runs over several lines:\n{stderr}"
    return errors[0]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["generate", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_clean_error(status: int, out: str, err: str, *fields: str) -> str:
    assert status == 2, err
    assert "Traceback" not in err
    assert out == ""
    line = error_line(err)
    assert any(field in line for field in fields), f"{line!r} names none of {fields}"
    return line


# Rejected before any model is loaded.
BAD_ARGUMENTS = {
    "max-tokens 0": (["Hello", "--max-tokens", "0"], ("max_tokens", "max-tokens")),
    "max-tokens negative": (["Hello", "--max-tokens", "-3"], ("max_tokens", "max-tokens")),
    "temperature -1": (["Hello", "--temperature", "-1"], ("temperature",)),
    "top-p 0": (["Hello", "--top-p", "0"], ("top_p", "top-p")),
    "top-p 1.5": (["Hello", "--top-p", "1.5"], ("top_p", "top-p")),
    "empty prompt": (["", "--chat"], ("prompt",)),
    "dtype float64": (["Hello", "--dtype", "float64"], ("dtype",)),
    "dtype with --router": (["Hello", "--router", "127.0.0.1:1", "--dtype", "bfloat16"], ("dtype",)),
    "device with --router": (["Hello", "--router", "127.0.0.1:1", "--device", "cpu"], ("device",)),
    "draft-quantization with --router": (
        ["Hello", "--router", "127.0.0.1:1", "--draft-quantization", "int8"],
        ("draft_quantization",),
    ),
    "int8 ngram drafter": (["Hello", "--drafter", "ngram", "--draft-quantization", "int8"], ("draft_quantization",)),
    "pipelined in this process": (["Hello", "--speculation", "pipelined"], ("speculation",)),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_is_one_line_naming_the_field(case: str, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_load(name: str, **kwargs):
        raise AssertionError("a bad argument must be rejected before loading a model")

    monkeypatch.setattr(specdec.models, "load_model", no_load)
    argv, fields = BAD_ARGUMENTS[case]
    assert_clean_error(*run_main(capsys, *argv), *fields)


def test_unknown_model_fails_fast(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    status, out, err = run_main(capsys, "Hello", "--target", "no-such-model-xyz", "--max-tokens", "4")
    elapsed = time.monotonic() - started
    line = assert_clean_error(status, out, err, "model")
    assert "no-such-model-xyz" in line
    assert elapsed < 5, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("device", ["cuda:99", "no-such-device"])
def test_a_device_this_machine_lacks_is_one_line_before_any_weights_load(capsys, device: str) -> None:
    started = time.monotonic()
    status, out, err = run_main(capsys, "Hello", "--device", device, "--drafter", "none", "--max-tokens", "2")
    assert device in assert_clean_error(status, out, err, "device")
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_generate_in_bfloat16_loads_the_models_in_it(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = []

    def load(name: str, **kwargs):
        model = load_model(name, **kwargs)
        loaded.append(model.model.dtype)
        return model

    monkeypatch.setattr(specdec.models, "load_model", load)
    status, out, err = run_main(capsys, "Hello", "--chat", "--dtype", "bfloat16", "--max-tokens", "4", "--json")
    assert status == 0, err
    assert loaded == [torch.bfloat16]
    assert 1 <= len(json.loads(out)["token_ids"]) <= 4


def test_subprocess_bad_input_has_no_traceback() -> None:
    """What a user sees: ``python -m specdec.cli`` with an unknown model, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "Hello", "--target", "no-such-model-xyz"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in completed.stderr, completed.stderr
    assert completed.returncode == 2, completed.stderr
    assert completed.stdout == ""
    line = error_line(completed.stderr)
    assert "model" in line and "no-such-model-xyz" in line


def test_target_without_tokenizer(capsys, tiny_dir: Path) -> None:
    """A local model directory without a tokenizer cannot turn the prompt text into ids: say so."""
    status, out, err = run_main(capsys, "Hello", "--target", str(tiny_dir), "--drafter", "none", "--max-tokens", "4")
    assert_clean_error(status, out, err, "tokenizer")


@pytest.mark.slow
def test_draft_with_another_vocabulary(capsys, cached_target, tiny_dir: Path) -> None:
    status, out, err = run_main(capsys, "Hello", "--drafter", "model", "--draft-model", str(tiny_dir))
    line = assert_clean_error(status, out, err, "draft")
    assert "vocabulary" in line and "16" in line and "49152" in line


@pytest.mark.slow
def test_context_overflow_names_max_tokens(capsys, cached_target) -> None:
    context = smollm2().model.config.max_position_embeddings
    status, out, err = run_main(capsys, "Hello", "--max-tokens", str(context), "--drafter", "none")
    assert_clean_error(status, out, err, "max_tokens", "max-tokens")


JSON_STATS = {
    "rounds": int,
    "draft_tokens": int,
    "accepted_tokens": int,
    "mean_accepted_length": float,
    "accepted_per_position": list,
    "draft_s": float,
    "verify_s": float,
    "tokens_per_s": float,
}


@pytest.mark.slow
def test_generate_json(capsys, cached_target) -> None:
    status, out, err = run_main(capsys, "Hello", "--chat", "--max-tokens", "8", "--json", "--drafter", "ngram")
    assert status == 0, err
    assert "Traceback" not in err
    lines = out.splitlines()
    assert len(lines) == 1, out
    result = json.loads(lines[0])
    assert isinstance(result, dict)
    assert {"text", "token_ids", "finish_reason", "stats"} <= result.keys()
    tokens = result["token_ids"]
    assert isinstance(tokens, list) and 1 <= len(tokens) <= 8 and all(type(token) is int for token in tokens)
    target = smollm2()
    assert result["text"] == target.tokenizer.decode(tokens, skip_special_tokens=True)
    if result["finish_reason"] == "length":
        assert len(tokens) == 8
    else:
        assert result["finish_reason"] == "stop" and tokens[-1] in target.eos_token_ids

    stats = result["stats"]
    for key, kind in JSON_STATS.items():
        assert isinstance(stats.get(key), kind), (key, stats.get(key))
    assert all(type(count) is int for count in stats["accepted_per_position"])
    assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["rounds"])
    assert min(stats["draft_s"], stats["verify_s"]) >= 0 and stats["tokens_per_s"] > 0

    # the default sampling is greedy: the tokens are target-only greedy decoding of the chat-templated prompt
    engine = Engine(KVRunner(target.model), target.eos_token_ids, None)
    prompt = encode_prompt(target, "Hello", chat=True)
    [expected] = engine.generate([GenerationRequest(prompt, SamplingParams(temperature=0.0), 8)])
    assert tokens == expected.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("speculation", ["off", "auto"])
def test_generate_speculation_in_this_process(capsys, cached_target, speculation: str) -> None:
    """``--speculation off`` drafts nothing; ``auto`` lets the goodput controller pick each round's draft length;
    greedy, both give target-only decoding's tokens."""
    status, out, err = run_main(
        capsys, "Hello", "--chat", "--max-tokens", "8", "--json", "--drafter", "ngram", "--speculation", speculation
    )
    assert status == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    target = smollm2()
    engine = Engine(KVRunner(target.model), target.eos_token_ids, None)
    [expected] = engine.generate([GenerationRequest(encode_prompt(target, "Hello", chat=True), SamplingParams(0.0), 8)])
    assert result["token_ids"] == expected.token_ids
    assert result["stats"]["rounds"] >= 1
    if speculation == "off":
        assert result["stats"]["draft_tokens"] == 0 and result["stats"]["rounds"] == len(expected.token_ids)


@pytest.mark.slow
def test_generate_text(capsys, cached_target) -> None:
    """Without ``--json``: the text on stdout, a one-line summary on stderr."""
    status, out, err = run_main(capsys, "Hello", "--chat", "--max-tokens", "6", "--drafter", "early-exit")
    assert status == 0, err
    target = smollm2()
    engine = Engine(KVRunner(target.model), target.eos_token_ids, None)  # greedy speculation is lossless
    prompt = encode_prompt(target, "Hello", chat=True)
    [expected] = engine.generate([GenerationRequest(prompt, SamplingParams(temperature=0.0), 6)])
    assert out == target.tokenizer.decode(expected.token_ids, skip_special_tokens=True) + "\n"
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(f"[{expected.finish_reason}] {len(expected.token_ids)} tokens in ")


def run_command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("size", ["0", "17"])
def test_distill_refuses_a_draft_vocabulary_outside_the_targets(
    size: str, capsys: pytest.CaptureFixture[str], tiny_dir: Path, tmp_path: Path
) -> None:
    status, _, stderr = run_command(
        capsys, "distill", "--target", str(tiny_dir), "--draft-vocab", size, "--out", str(tmp_path)
    )
    assert status == 2
    assert error_line(stderr) == f"{ERROR_PREFIX}draft_vocab: must be in [1, 16] (the target's vocabulary), got {size}"


def test_distill_refuses_fewer_than_one_response_per_prompt(
    capsys: pytest.CaptureFixture[str], tiny_dir: Path, tmp_path: Path
) -> None:
    status, _, stderr = run_command(
        capsys,
        "distill",
        "--target",
        str(tiny_dir),
        "--draft-vocab",
        "8",
        "--responses-per-prompt",
        "0",
        "--out",
        str(tmp_path),
    )
    assert status == 2
    assert error_line(stderr) == f"{ERROR_PREFIX}responses_per_prompt: must be >= 1, got 0"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--categories", "chat,poems"], "categories: unknown poems; the prompt set has chat, code, "),
        (["--categories", "chat", "--data", "mine.jsonl"], "categories: chooses from the built-in prompt set; --data"),
    ],
)
def test_distill_refuses_categories_the_prompt_set_lacks_or_beside_own_data(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str], tiny_dir: Path, tmp_path: Path
) -> None:
    status, _, stderr = run_command(
        capsys, "distill", "--target", str(tiny_dir), "--draft-vocab", "8", "--out", str(tmp_path), *extra
    )
    assert status == 2
    assert error_line(stderr).startswith(f"{ERROR_PREFIX}{message}")


def test_distill_samples_every_response_past_a_prompts_first() -> None:
    first = [resample_id("chat-0001", 0), resample_id("chat-0002", 0)]
    further = [resample_id("chat-0001", 1), resample_id("chat-0001", 2)]
    assert first == ["chat-0001", "chat-0002"] and len(set(further)) == 2
    assert [sampling_for(index, first[0]).temperature for index in range(4)] == [0.0, 0.0, 0.0, 0.7]
    assert [sampling_for(index, further[0]).temperature for index in range(4)] == [0.7] * 4


def test_an_eagle_head_made_for_another_target_is_one_line(
    capsys: pytest.CaptureFixture[str], tiny_dir: Path, tmp_path: Path
) -> None:
    other = tiny_llama(seed=4, vocab_size=32)
    save_head(EagleHead.from_target(other.model, torch.arange(32)), tmp_path, HeadInfo("other", 4))
    status, _, stderr = run_main(
        capsys, "x", "--target", str(tiny_dir), "--drafter", "eagle", "--draft-model", str(tmp_path)
    )
    assert status == 2
    assert "draft_model: head vocabulary 32 != the target's 16" in error_line(stderr)
