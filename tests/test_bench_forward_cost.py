"""The forward-cost benchmark on a tiny random Llama: every runner and position count timed in every repeat,
nothing left open in the runners, and a report with one row per (dtype, kernels, threads, batch, positions)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.forward_cost import main, time_forwards
from specdec.runner import KVRunner
from tests.tiny_models import tiny_llama


def test_every_runner_and_position_count_is_timed_in_every_repeat_and_no_sequence_is_left_open() -> None:
    model = tiny_llama(seed=0, vocab_size=32).model
    runners = {"packed": KVRunner(model, pack_weights=True), "plain": KVRunner(model, pack_weights=False)}
    times = time_forwards(
        runners, torch.device("cpu"), batch_size=2, positions=[1, 3], context=5, number=2, repeats=3, seed=0
    )
    assert sorted(times) == [("packed", 1), ("packed", 3), ("plain", 1), ("plain", 3)]
    assert all(len(samples) == 3 and min(samples) > 0 for samples in times.values())
    assert all(runner.num_open == 0 for runner in runners.values())


def test_the_report_has_a_row_per_configuration_and_ratios_to_one_position(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    tiny_llama(seed=1, vocab_size=32).model.save_pretrained(model_dir)
    argv = ["--target", str(model_dir), "--kernels", "packed,plain", "--threads", "1", "--batch-sizes", "1,2"]
    argv += ["--positions", "1,2"]
    argv += ["--context", "4", "--number", "1", "--repeats", "2", "--result-dir", str(tmp_path), "--name", "fc"]
    assert main(argv) == 0
    document = json.loads((tmp_path / "fc.json").read_text())
    cells = sorted((row["kernels"], row["batch_size"], row["positions"]) for row in document["rows"])
    assert cells == [(kernels, b, p) for kernels in ("packed", "plain") for b in (1, 2) for p in (1, 2)]
    assert all(row["ratio_to_fewest"] == 1.0 for row in document["rows"] if row["positions"] == 1)
    assert all(row["ratio_to_plain"] == 1.0 for row in document["rows"] if row["kernels"] == "plain")
    report = (tmp_path / "fc.md").read_text()
    assert report.count("| float32 | packed | 1 |") == 4 and report.count("| float32 | plain | 1 |") == 4
