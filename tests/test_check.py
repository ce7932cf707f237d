"""``specdec check`` end to end: through real services on tiny models every shipped mode passes, and a verifier
built with a deliberately wrong acceptance rule fails it.

Tiny random Llama target (vocabulary 5) and a related draft behind a real verifier, a model drafter and the
router (:func:`tests.test_router_distribution.served_router`). The check discovers the drafter kind from the
router's ``Status``, runs the greedy identity test on three token-id prompts, then the two-token law at T = 1
for one prompt: sequential, pipelined and tree configurations against speculation off, with the wrong law at
0.5 × T as the power control (the tiny model's law at 0.8 × T is too close to tell apart with ~200 requests).
Seeds are fixed, so each run is deterministic up to batch composition.

The wrong rule accepts a draft token with probability ``sqrt(p / q)`` instead of ``min(1, p / q)`` (uniforms
squared): it over-accepts the drafter's favourites; greedy is untouched, so only the law test can see it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from drafter_service.config import DrafterConfig
from specdec.acceptance import verify_batched
from specdec.check.backends import Generation, Prompt
from specdec.check.command import read_prompts
from specdec.check.runner import CheckConfig, Mode, Setting, report_markdown, run_check
from specdec.cli import main
from tests.test_router_distribution import served_router
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 5
PROMPTS = "[1, 2, 3, 1, 2]\n[4, 0, 2]\n# a comment\n[3, 3, 1, 0]\n"


def over_accepting_rule(trees, target_probs, draft_probs, accept_uniforms, draw_uniforms, **options):
    """Accept with probability sqrt(p / q): ``u² < p / q``. Not lossless."""
    return verify_batched(trees, target_probs, draft_probs, accept_uniforms**2, draw_uniforms, **options)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=11, vocab_size=VOCAB, num_layers=2)
    return target, tiny_draft(target, seed=12, num_layers=1, noise=0.3)


@pytest.fixture(scope="module")
def router(models) -> Iterator[tuple[str, str]]:
    target, draft = models
    with served_router(target, DrafterConfig(kind="model", draft_model=draft.name), draft=draft) as served:
        yield served.grpc_address, served.http_address


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS)
    return path


def check_args(prompts: Path, output: Path, *extra: str) -> list[str]:
    return [
        "check",
        "--prompts",
        str(prompts),
        "--distribution-prompts",
        "1",
        "--sampling",
        "temperature=1.0",
        "--tokens",
        "2",
        "--greedy-tokens",
        "8",
        "--tree-depth",
        "2",
        "--control-temperature-factor",
        "0.5",
        "--output",
        str(output),
        "--no-progress",
        *extra,
    ]


def test_every_shipped_mode_passes(router, prompts: Path, tmp_path: Path) -> None:
    address, _ = router
    code = main([*check_args(prompts, tmp_path / "report", "--requests", "1400"), "--router", address])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, (tmp_path / "report.md").read_text()
    assert report["verdict"] == "pass"
    assert report["greedy"] == {"compared": 12, "max_tokens": 8, "mismatches": []}
    modes = [row["mode"] for row in report["distribution"]]
    assert modes == [
        "model/sequential γ=default",
        "model/pipelined γ=default",
        "model/tree w=2 γ=2",
        "model/auto γ=default",
    ]
    for row in report["distribution"]:
        assert row["status"] == "pass"
        assert row["real"]["samples"][0] >= 200 and row["real"]["tables_tested"] >= 3
        assert row["control"]["adjusted_p"] < 0.01 <= row["real"]["adjusted_p"]
    assert (tmp_path / "report.md").read_text().startswith("# specdec check: PASS")


def test_the_check_over_http(router, prompts: Path, tmp_path: Path) -> None:
    """The HTTP API returns per-token strings, not ids; the check compares those (here ``str(id)``: no tokenizer)."""
    _, http = router
    args = [*check_args(prompts, tmp_path / "http", "--drafters", "model", "--modes", "pipelined"), "--requests", "700"]
    code = main([*args, "--base-url", f"http://{http}"])
    report = json.loads((tmp_path / "http.json").read_text())
    assert code == 0, (tmp_path / "http.md").read_text()
    assert report["greedy"]["compared"] == 3 and report["error_count"] == 0
    [row] = report["distribution"]
    assert row["status"] == "pass" and row["real"]["samples"][0] >= 200
    assert row["real"]["most_significant_tables"][0]["tokens"][0] in {str(token) for token in range(VOCAB)}


def test_a_wrong_acceptance_rule_fails(models, prompts: Path, tmp_path: Path) -> None:
    target, draft = models
    config = DrafterConfig(kind="model", draft_model=draft.name)
    with served_router(target, config, acceptance_rule=over_accepting_rule, draft=draft) as served:
        args = check_args(prompts, tmp_path / "fault", "--modes", "sequential", "--requests", "700")
        code = main([*args, "--router", served.grpc_address])
    report = json.loads((tmp_path / "fault.json").read_text())
    assert code == 1
    assert report["verdict"] == "fail" and report["greedy"]["mismatches"] == []  # greedy cannot see this rule
    [row] = report["distribution"]
    assert row["status"] == "fail" and row["real"]["adjusted_p"] < 1e-3
    assert "Most deviant table" in (tmp_path / "fault.md").read_text()


class SameLawBackend:
    """A fake router whose output law ignores everything (even the temperature): the wrong law is the real one."""

    async def generate(self, prompt: Prompt, *, chat: bool, options: dict) -> Generation:
        generator = torch.Generator().manual_seed(options["seed"])
        tokens = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), options["max_tokens"], True, generator=generator)
        return Generation(tuple(tokens.tolist()), False)

    async def drafter_kinds(self) -> tuple[str, ...]:
        return ("ngram",)

    async def close(self) -> None:
        pass


def test_a_check_that_cannot_see_the_wrong_law_is_underpowered_not_pass() -> None:
    config = CheckConfig(
        prompts=(Prompt("p", ids=(1, 2)),),
        modes=(Mode("ngram", "sequential"),),
        settings=(Setting(1.0),),
        tokens=2,
        requests=300,
        greedy=False,
    )
    result = asyncio.run(run_check(SameLawBackend(), config, target="fake", progress=False))
    [row] = result.distribution
    assert row.comparison.real.samples == (100, 100)  # 300 requests over three samples, round robin
    assert row.status == "underpowered" and result.exit_code == 3


def test_a_minutes_budget_stops_the_check_with_samples_of_about_equal_size() -> None:
    config = CheckConfig(
        prompts=(Prompt("p", ids=(1, 2)),),
        modes=(Mode("ngram", "sequential"), Mode("ngram", "pipelined")),
        settings=(Setting(1.0),),
        tokens=2,
        requests=None,
        minutes=0.02,
        concurrency=4,
    )
    result = asyncio.run(run_check(SameLawBackend(), config, target="fake", progress=False))
    assert result.budget_exhausted_by == "minutes" and result.greedy_checked == 2
    sizes = [size for row in result.distribution for size in row.comparison.real.samples]
    assert min(sizes) > 20 and max(sizes) - min(sizes) <= 4  # round robin: at most one in-flight round apart


def test_settings_and_prompt_files_parse(tmp_path: Path) -> None:
    assert Setting.parse("temperature=0.8,top_p=0.9") == Setting(0.8, top_p=0.9)
    assert Setting.parse("t=1,k=20").label == "T=1 top_k=20"
    for bad in ("top_p=0.9", "temperature=0", "temperature=1,colour=red"):
        with pytest.raises(ValueError):
            Setting.parse(bad)
    path = tmp_path / "prompts.txt"
    path.write_text('[1, 2]\n"two\\nlines"\nplain text\n\n# comment\n')
    assert [(p.ids, p.text) for p in read_prompts(path)] == [((1, 2), None), (None, "two\nlines"), (None, "plain text")]


class GreedyDiffersBackend(SameLawBackend):
    """Speculation changes the greedy output from its fourth token on."""

    async def generate(self, prompt: Prompt, *, chat: bool, options: dict) -> Generation:
        tokens = [1, 2, 3, 4, 5, 6]
        if options["speculation"] != "off":
            tokens[3] = 0
        return Generation(tuple(tokens[: options["max_tokens"]]), False)


def test_a_greedy_mismatch_is_reported_with_its_prompt_and_first_position() -> None:
    config = CheckConfig(
        prompts=(Prompt("p", ids=(1, 2)),), modes=(Mode("ngram", "pipelined"),), greedy_tokens=6, distribution=False
    )
    result = asyncio.run(run_check(GreedyDiffersBackend(), config, target="fake", progress=False))
    assert result.exit_code == 1 and result.greedy_checked == 1
    [mismatch] = result.greedy
    assert (mismatch.prompt, mismatch.mode, mismatch.position) == ("p", "ngram/pipelined γ=default", 3)
    assert mismatch.off_tokens == [4, 5, 6] and mismatch.mode_tokens == [0, 5, 6]
    assert "| p | ngram/pipelined γ=default | 3 | 4 5 6 | 0 5 6 |" in report_markdown(result)
