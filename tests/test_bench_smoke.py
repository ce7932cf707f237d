"""The disaggregated benchmark's pure maths and report, on hand-made stats (no model, no servers); the EAGLE
benchmark's acceptance section on a tiny random model and head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.disaggregated import (
    RequestRecord,
    Run,
    exposed_draft_fraction,
    mark_batch_timing,
    markdown,
    summarize,
)

ROOT = Path(__file__).resolve().parent.parent
META = {
    "target": "tiny",
    "date": "2026-01-01 00:00 UTC",
    "cpu": "test CPU",
    "cpus": 2,
    "load_before": "0.00/0.00/0.00",
    "load_after": "0.00/0.00/0.00",
    "python": "3.11",
    "torch": "x",
    "transformers": "y",
    "grpcio": "z",
    "max_tokens": 8,
    "num_draft_tokens": 4,
    "num_prompts": 2,
    "categories": ["code"],
    "streams": [1],
    "threads": {"colocated": 1, "verifier": 1, "drafter": 1},
}


def test_the_pure_helpers_load_without_torch() -> None:
    check = "import sys, bench.disaggregated; assert 'torch' not in sys.modules and 'grpc' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True, timeout=30)


def test_exposed_draft_is_all_of_it_unless_pipelined() -> None:
    assert exposed_draft_fraction("off", 10, 0, 0) == 1.0
    assert exposed_draft_fraction("sequential", 10, 0, 0) == 1.0
    # 10 rounds, 4 fed by a pre-drafted chain: 6 fresh proposals out of 6 + (4 + 3) pre-drafts = 13 in all.
    assert exposed_draft_fraction("pipelined", 10, 4, 3) == pytest.approx(6 / 13)
    assert exposed_draft_fraction("pipelined", 0, 0, 0) == 0.0
    assert exposed_draft_fraction("auto", 10, 0, 0) == 1.0  # no round pipelined
    assert exposed_draft_fraction("auto", 10, 4, 3) == pytest.approx(6 / 13)


def test_summary_of_a_sequential_run() -> None:
    # Two requests: 12 tokens in 4 rounds and 6 tokens in 2 rounds -> E[N] = 3.
    records = [
        RequestRecord(0, [1] * 12, e2e_s=0.40, rounds=4, draft_tokens=16, accepted_tokens=8, draft_s=0.008,
                      verify_s=0.320, state_s=0.004, wire_bytes=400, ttft_s=0.1),
        RequestRecord(1, [2] * 6, e2e_s=0.20, rounds=2, draft_tokens=8, accepted_tokens=4, draft_s=0.004,
                      verify_s=0.160, state_s=0.002, wire_bytes=200, ttft_s=0.3),
    ]  # fmt: skip
    run = Run("disaggregated", "sequential", 1, records, wall_s=0.60)
    summary = summarize(run, reference=[[1] * 12, [9] * 6])
    assert summary.tokens == 18
    assert summary.tokens_per_s == pytest.approx(30.0)
    assert summary.tokens_per_round == pytest.approx(3.0)
    assert summary.mean_accepted_length == pytest.approx(1 + 12 / 6)
    assert summary.acceptance_rate == pytest.approx(12 / 24)
    assert summary.draft_ms_per_round == pytest.approx(2.0)
    assert summary.verify_ms_per_round == pytest.approx(80.0)
    assert summary.state_ms_per_round == pytest.approx(1.0)
    assert summary.wall_ms_per_round == pytest.approx(100.0)
    assert summary.wire_bytes_per_round == pytest.approx(100.0)
    # Sequential: the verifier waited for all of the draft.
    assert summary.overhead_ms_per_round == pytest.approx(100.0 - 2.0 - 80.0 - 1.0)
    assert summary.ms_per_token == pytest.approx(100.0 / 3)
    assert summary.bound_ms_per_token == pytest.approx(81.0 / 3)
    assert summary.ratio_to_bound == pytest.approx(100.0 / 81.0)
    assert summary.pipeline_hit_rate is None
    assert summary.ttft_ms_median == pytest.approx(200.0)
    assert summary.same_as_reference == 1


def test_pipelined_overhead_subtracts_only_the_fresh_drafts() -> None:
    record = RequestRecord(0, [5] * 20, e2e_s=1.0, rounds=10, draft_s=0.130, verify_s=0.5, state_s=0.0,
                           pipeline_hits=4, pipeline_misses=3)  # fmt: skip
    summary = summarize(Run("disaggregated", "pipelined", 1, [record], wall_s=1.0))
    assert summary.pipeline_hit_rate == pytest.approx(4 / 7)
    exposed = 13.0 * 6 / 13  # 13 ms of draft per round, 6 of 13 proposals on the critical path
    assert summary.exposed_draft_ms_per_round == pytest.approx(exposed)
    assert summary.overhead_ms_per_round == pytest.approx(100.0 - exposed - 50.0)
    assert summary.bound_ms_per_token == pytest.approx(50.0 / 2)
    assert summary.same_as_reference == 0  # no reference given


def test_a_static_batch_is_timed_by_its_longest_stream() -> None:
    records = [
        RequestRecord(0, [1] * 4, e2e_s=0.0, rounds=4, verify_s=0.2),
        RequestRecord(1, [1] * 8, e2e_s=0.0, rounds=8, verify_s=0.4),
    ]
    mark_batch_timing(records, elapsed_s=0.5)
    assert [r.timed for r in records] == [False, True]
    assert [r.e2e_s for r in records] == [0.5, 0.5]
    summary = summarize(Run("co-located", "off", 2, records, wall_s=0.5))
    assert summary.wall_ms_per_round == pytest.approx(500.0 / 8)
    assert summary.verify_ms_per_round == pytest.approx(50.0)
    assert summary.tokens_per_s == pytest.approx(24.0)
    assert summary.wire_bytes_per_round is None


def test_no_completed_round_is_an_error() -> None:
    with pytest.raises(ValueError, match="no timed request"):
        summarize(Run("disaggregated", "off", 1, [RequestRecord(0, [], e2e_s=0.1, rounds=0)], wall_s=0.1))


def test_report_rows_and_verdict() -> None:
    same = RequestRecord(0, [1, 2], e2e_s=0.1, rounds=2, verify_s=0.08)
    differs = RequestRecord(0, [1, 3], e2e_s=0.1, rounds=1, verify_s=0.08, accepted_tokens=1)
    runs = [Run("co-located", "off", 1, [same], 0.1), Run("disaggregated", "sequential", 1, [differs], 0.1)]
    reference = [[1, 2]]
    report = markdown([summarize(run, reference) for run in runs], META)
    assert "| 1 | co-located target-only | 2 |" in report
    assert "| 1 | disaggregated sequential (ngram) | 2 |" in report
    assert "every configuration: **NO**" in report
    assert "overhead ms/round** = wall ms/round − exposed draft" in report
    assert report.count("\n| 1 |") == 2
    assert f"γ = {META['num_draft_tokens']}," in report
    tree = {**META, "num_draft_tokens": 3, "tree_width": 3, "tree_budget": 4}
    assert "tree depth 3, width 3, 4 nodes," in markdown([summarize(run, reference) for run in runs], tree)


def test_eagle_acceptance_section_on_a_tiny_model(tmp_path: Path) -> None:
    import torch

    from bench.eagle import MAX_DEPTH, SAMPLINGS, SHAPES, Prompt, Settings, describe, run_sections
    from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
    from tests.tiny_models import tiny_llama

    target = tiny_llama(seed=3, vocab_size=32, num_layers=2)
    head = tmp_path / "head"
    save_head(EagleHead.from_target(target.model, torch.arange(32)), head, HeadInfo(target.name, 4))
    generator = torch.Generator().manual_seed(0)
    prompts = [Prompt(str(i), c, torch.randint(0, 31, (10,), generator=generator).tolist()) for i, c in enumerate("ab")]
    meta = describe(target.name, str(head), prompts, 16, "python -m bench.eagle --sections acceptance")
    run_sections(target, prompts, ["acceptance"], Settings(16, str(head)), meta, tmp_path / "out" / "eagle")

    payload = json.loads((tmp_path / "out" / "eagle.json").read_text())
    assert set(payload) == {"meta", "definitions", "acceptance"}
    rows = payload["acceptance"]["rows"]
    assert [(r["sampling"], r["shape"]) for r in rows] == [(s, shape) for s in SAMPLINGS for shape in SHAPES]
    for row, config in zip(rows, [*SHAPES.values()] * len(SAMPLINGS), strict=True):
        depth = config.num_draft_tokens
        assert row["requests"] == 2 and 0 < row["tokens"] <= 2 * 16
        # the first round of each request drafts nothing; every other one here has room to draft
        assert row["drafted_rounds"] + row["requests"] <= row["rounds"]
        assert row["drafted_rounds"] > 0 and row["draft_tokens"] <= row["drafted_rounds"] * config.max_nodes
        assert 0 <= row["acceptance_rate"] <= 1
        assert len(row["acc"]) == depth and all(0 <= a <= 1 for a in row["acc"])
        assert row["acc"] == sorted(row["acc"], reverse=True)
        assert 1 <= row["tokens_per_round"] <= row["mean_accepted_length"] <= 1 + depth
        assert row["mean_accepted_length"] == pytest.approx(1 + sum(row["acc"]))
        assert row["draft_ms_per_token"] > 0 and row["target_forward_ms"] > 0 and row["draft_to_forward"] > 0
        assert row["tokens_per_s"] > 0
        assert set(row["by_category"]) == {"a", "b"}
    assert any(row["accepted_tokens"] for row in rows)
    report = (tmp_path / "out" / "eagle.md").read_text()
    assert f"acc@{MAX_DEPTH} |" in report and report.count("\n| greedy | chain γ=") == sum(
        name.startswith("chain") for name in SHAPES
    )


def test_eagle_lookup_section_on_a_tiny_model(tmp_path: Path) -> None:
    """Target-only, ngram, the head alone and each lookup threshold, greedy and T = 0.7, with each category's tokens
    per round and speed-up; a prompt repeating itself is drafted from its first round on by lookup only."""
    from bench.eagle import LOOKUP_MIN_MATCHES, SAMPLINGS

    rows, report = _tiny_eagle_section(tmp_path, "lookup")
    names = ["target-only", "ngram", *(f"lookup ≥ {m}" if m else "head alone" for m in LOOKUP_MIN_MATCHES)]
    assert [(r["sampling"], r["config"]) for r in rows] == [(s, n) for s in SAMPLINGS for n in names]
    for row in rows:
        assert set(row["by_category"]) == {"a", "b"} and row["speedup"] > 0
        if row["config"] == "target-only":
            assert row["speedup"] == 1 and row["draft_tokens"] == 0
    by_name = {(r["sampling"], r["config"]): r for r in rows}
    # every request's first round: nothing to draft from for the head, a whole chain by lookup on the copy prompt
    assert by_name["greedy", "lookup ≥ 5"]["drafted_rounds"] > by_name["greedy", "head alone"]["drafted_rounds"]
    assert by_name["greedy", "ngram"]["draft_tokens"] > 0
    assert "| greedy | lookup ≥ 5 |" in report and "| greedy | ngram |" in report


def test_eagle_trees_section_on_a_tiny_model(tmp_path: Path) -> None:
    """Target-only and each of the chains and dynamic trees, greedy as served: every row gives target-only's tokens."""
    from bench.eagle import TREE_SHAPES

    rows, report = _tiny_eagle_section(tmp_path, "trees")
    assert [row["name"] for row in rows] == ["target-only", *(f"eagle {shape}" for shape in TREE_SHAPES)]
    assert all(row["same_as_target_only"] == 2 and row["speedup"] > 0 for row in rows)
    assert "| greedy | eagle tree d3 w3 b4 |" in report


def _tiny_target_and_head(tmp_path: Path):
    """A tiny target and its untrained eagle head, saved under ``tmp_path / "head"``."""
    import torch

    from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
    from tests.tiny_models import tiny_llama

    target = tiny_llama(seed=3, vocab_size=32, num_layers=2)
    head = tmp_path / "head"
    save_head(EagleHead.from_target(target.model, torch.arange(32)), head, HeadInfo(target.name, 4))
    return target, head


def _tiny_eagle_section(tmp_path: Path, section: str) -> tuple[list[dict], str]:
    """One ``bench.eagle`` section on a tiny target and its untrained head, over a prompt that repeats itself and
    one that does not (8 new tokens): the section's rows and the markdown report."""
    from bench.eagle import Prompt, Settings, describe, run_sections

    target, head = _tiny_target_and_head(tmp_path)
    prompts = [Prompt("copy", "a", [3, 4, 5, 6, 7, 8] * 2), Prompt("plain", "b", [9, 1, 2, 11, 13, 17])]
    meta = describe(target.name, str(head), prompts, 8, f"python -m bench.eagle --sections {section}")
    run_sections(target, prompts, [section], Settings(8, str(head)), meta, tmp_path / "out" / "eagle")
    rows = json.loads((tmp_path / "out" / "eagle.json").read_text())[section]["rows"]
    return rows, (tmp_path / "out" / "eagle.md").read_text()


def test_adaptive_bench_with_a_tree_on_a_tiny_model(tmp_path: Path) -> None:
    """``bench.adaptive`` with a tree shape: off, the chain and the tree, each fixed and under ``auto``, on groups of
    one and of two prompts; every greedy output equals speculation off's (``run_point`` checks) and every row counts
    the rounds it ran."""
    from bench.adaptive import engines, run_point
    from specdec.drafters import DraftConfig
    from specdec.sampling import SamplingParams

    target, head = _tiny_target_and_head(tmp_path)
    configs = engines(target, str(head), 3, DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=4))
    assert list(configs) == [
        "off",
        "eagle γ=3",
        "eagle auto (γ≤3)",
        "eagle tree d3 w2 b4",
        "eagle tree auto (d3 w2 b4)",
    ]
    prompts = [[3, 4, 5, 6, 7, 8] * 2, [9, 1, 2, 11, 13, 17]]
    for batch in (1, 2):
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        rows = run_point(configs, groups, SamplingParams(temperature=0.0), 8)
        assert set(rows) == set(configs) and rows["off"]["vs_off"] == 1.0
        assert all(sum(row["rounds_per_draft_size"].values()) > 0 for row in rows.values())


@pytest.mark.parametrize("feature_layers", [(), (0, 1)], ids=["final-norm", "fused"])
def test_eagle_agreement_section_serves_what_training_learnt(tmp_path: Path, feature_layers: tuple[int, ...]) -> None:
    """A head trained on the target's greedy answers to these very prompts agrees on most of their positions when
    drafted through the served drafter from the true features; the counts add up."""
    import torch

    from bench.eagle import Prompt, Settings, describe, run_sections
    from specdec.engine import Engine, GenerationRequest
    from specdec.runner import KVRunner
    from specdec.sampling import SamplingParams
    from tests.eagle_heads import memorised_head
    from tests.tiny_models import tiny_llama

    # memorised_head keeps a 1024-token draft vocabulary
    target = tiny_llama(seed=3, vocab_size=1024, num_layers=2)
    generator = torch.Generator().manual_seed(0)
    prompts = [Prompt(str(i), c, torch.randint(0, 999, (6,), generator=generator).tolist()) for i, c in enumerate("ab")]
    engine = Engine(KVRunner(target.model), target.eos_token_ids)
    greedy = SamplingParams(temperature=0.0)
    answers = [engine.generate([GenerationRequest(p.token_ids, greedy, 16)])[0].token_ids for p in prompts]
    texts = [(p.token_ids, answer) for p, answer in zip(prompts, answers, strict=True)]
    head = memorised_head(target, texts, tmp_path / "head", steps=300, feature_layers=feature_layers)
    meta = describe(target.name, str(head), prompts, 16, "python -m bench.eagle --sections agreement")
    run_sections(target, prompts, ["agreement"], Settings(16, str(head)), meta, tmp_path / "out" / "eagle")

    [row] = json.loads((tmp_path / "out" / "eagle.json").read_text())["agreement"]["rows"]
    assert row["positions"] == sum(len(answer) - 1 for answer in answers)
    assert row["after_agreed_positions"] + row["after_missed_positions"] == row["positions"] - len(prompts)
    assert row["agreement"] > 0.8, row  # measured 0.90 (final-norm rows); training itself reported 0.91
    assert row["outside_draft_vocab"] == 0.0  # the head's vocabulary holds every token it was trained on
    assert "| positions | agreement as served |" in (tmp_path / "out" / "eagle.md").read_text()


def test_eagle_context_bench_times_first_drafts_and_serves_long_prompts_exactly(tmp_path: Path) -> None:
    """Both parts of ``bench.eagle_context`` on a tiny target: a first-draft time per (length, context), and the
    long-prompt rows, whose greedy outputs equal target-only's; the report renders them."""
    import torch

    from bench.eagle import Prompt
    from bench.eagle_context import UNBOUNDED, first_draft_rows, long_prompt_rows, markdown
    from specdec.drafters.eagle_head import EagleHead
    from tests.tiny_models import tiny_llama

    target = tiny_llama(seed=3, vocab_size=16, num_layers=2)
    head = EagleHead.from_target(target.model, torch.arange(16), feature_layers=(0, 1)).eval().requires_grad_(False)
    timed = first_draft_rows(head, [8, 40], [4, UNBOUNDED], repeats=1)
    assert sorted((row["prompt_tokens"], row["context"]) for row in timed) == [
        (8, "last 4"),
        (8, "whole text"),
        (40, "last 4"),
        (40, "whole text"),
    ]
    assert all(row["total_ms"] > 0 for row in timed)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        Prompt(str(i), "long-context", torch.randint(0, 15, (60,), generator=generator).tolist()) for i in range(2)
    ]
    rows = long_prompt_rows(target, head, [4, UNBOUNDED], prompts, gamma=2, max_tokens=8)
    assert [row["config"] for row in rows] == ["target-only", "last 4", "whole text"]
    assert all(row["same_as_target_only"] == 2 and row["tokens"] == rows[0]["tokens"] for row in rows)
    document = {
        "meta": {"date": "now", "command": ["python", "-m", "bench.eagle_context"]},
        "head": "tiny",
        "threads": 1,
        "first_draft": timed,
        "long_prompts": rows,
        "num_prompts": 2,
        "num_draft_tokens": 2,
        "prompt_tokens_min": 60,
        "prompt_tokens_max": 60,
    }
    report = markdown(document)
    assert "| 40 | last 4 |" in report and f"| last 4 | {rows[0]['tokens']} |" in report


def test_eagle_context_agreement_part_tallies_every_answer_position_per_head_and_set(tmp_path: Path) -> None:
    """The agreement part of ``bench.eagle_context``: one row per (head, prompt set), every answer position after the
    first counted, and the report's table."""
    import torch

    from bench.eagle_context import agreement_rows, markdown
    from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
    from tests.tiny_models import tiny_llama

    target = tiny_llama(seed=3, vocab_size=16, num_layers=2, max_positions=1024)
    heads = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        head = EagleHead.from_target(target.model, torch.arange(16), feature_layers=(0, 1))
        save_head(head, tmp_path / f"head{seed}", HeadInfo(target.name, 4))
        heads.append(tmp_path / f"head{seed}")
    generator = torch.Generator().manual_seed(0)
    sets = {
        "short": [torch.randint(0, 15, (9,), generator=generator).tolist() for _ in range(2)],
        "long": [torch.randint(0, 15, (700,), generator=generator).tolist()],
    }
    rows = agreement_rows(target, heads, sets, max_tokens=6)
    assert [(row["head"], row["set"]) for row in rows] == [(str(h), name) for h in heads for name in ("short", "long")]
    for row in rows:
        answers = len(sets[row["set"]])
        assert answers <= row["positions"] <= 5 * answers  # up to 6 tokens each, the first one drafted from no row
        assert 0.0 <= row["agreement"] <= 1.0
    assert rows[1]["mean_prompt_tokens"] == 700
    meta = {"date": "now", "command": ["python", "-m", "bench.eagle_context"]}
    report = markdown({"meta": meta, "head": "tiny", "threads": 1, "agreement": rows, "max_tokens": 6})
    assert f"| `{heads[1]}` | long | 1 | 700 |" in report and "First draft" not in report


def test_distill_data_bench_times_both_dtypes_on_the_same_prompts_and_training_in_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.distill_data
    from tests.tiny_models import smollm2

    monkeypatch.setattr(bench.distill_data, "load_model", lambda name, **_: smollm2())
    argv = ["--prompts", "3", "--max-tokens", "4", "--repeats", "1", "--batch-sizes", "2", "--train-steps", "2",
            "--draft-vocab", "256", "--result-dir", str(tmp_path), "--name", "data"]  # fmt: skip
    assert bench.distill_data.main(argv) == 0
    document = json.loads((tmp_path / "data.json").read_text())
    rows = document["rows"]
    assert [(row["dtype"], row["batch_size"]) for row in rows] == [("float32", 2), ("bfloat16", 2)]
    assert all(row["tokens_per_s"] > 0 for row in rows)
    assert rows[0]["identical_to_float32"] == 1.0
    training = document["training_rows"]
    assert [row["dtype"] for row in training] == ["float32", "bfloat16"]
    assert all(row["steps_per_s"] > 0 and row["tokens_per_s"] > 0 for row in training)
    assert document["auto_train_dtype"] in ("float32", "bfloat16")
    report = (tmp_path / "data.md").read_text()
    assert "| bfloat16 | 2 |" in report and "| training dtype |" in report


def test_distill_data_bench_trains_on_the_cached_distill_data_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.distill_data
    from specdec.cache import distill_data_dir
    from specdec.distill.data import ShardWriter, generate_examples
    from specdec.drafters.eagle_head import eagle3_layers
    from specdec.runner import KVRunner
    from specdec.sampling import SamplingParams
    from tests.tiny_models import SMOLLM2, smollm2

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench.distill_data, "load_model", lambda name, **_: smollm2())
    runner = KVRunner(smollm2().model)
    writer = ShardWriter(distill_data_dir(SMOLLM2) / "train")
    prompts = [(f"p{i}", [1, 4 + i, 9, 30 + i, 2]) for i in range(3)]
    greedy = SamplingParams(temperature=0.0)
    layers = eagle3_layers(runner.num_layers)
    for example in generate_examples(
        runner, frozenset(), prompts, max_tokens=4, batch_size=3, sampling_for=lambda _: greedy, seed=0,
        fused_layers=layers,
    ):  # fmt: skip
        writer.add(example)
    writer.flush()
    argv = ["--cached-data", "--prompts", "2", "--repeats", "1", "--dtypes", "float32", "--train-steps", "1",
            "--draft-vocab", "256", "--result-dir", str(tmp_path), "--name", "cached"]  # fmt: skip
    assert bench.distill_data.main(argv) == 0
    document = json.loads((tmp_path / "cached.json").read_text())
    assert document["rows"] == [] and document["training_examples"] == 2
    assert [row["dtype"] for row in document["training_rows"]] == ["float32"]
    assert "the cached `specdec distill` data" in (tmp_path / "cached.md").read_text()
