"""bench.pipeline_ratio's pieces: a widened head keeps its weights and gains the target's LM-head rows; the ratio
row puts pipelined over sequential beside its bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.pipeline_ratio import summarise, widened_head
from bench.pipelining import Tally
from specdec.client import Stats
from specdec.drafters.eagle_head import EagleHead, HeadInfo, load_head, save_head
from tests.tiny_models import tiny_llama


def test_a_widened_head_keeps_its_tokens_and_weights_and_reads_the_targets_rows(tmp_path: Path) -> None:
    target = tiny_llama(seed=7, vocab_size=16, num_layers=2)
    head = EagleHead.from_target(target.model, torch.tensor([2, 5, 9, 15]), feature_layers=(0, 1))
    save_head(head, tmp_path / "head", HeadInfo(target.name, 4))
    wide, _ = load_head(widened_head(tmp_path / "head", target.model, 7, tmp_path / "wide"))
    assert wide.draft_to_target.tolist() == [0, 1, 2, 3, 5, 9, 15]  # its own 4, then the lowest other ids
    torch.testing.assert_close(wide.lm_head.weight, target.model.lm_head.weight[wide.draft_to_target])
    kept = {
        name: value for name, value in wide.state_dict().items() if name not in ("lm_head.weight", "draft_to_target")
    }
    for name, value in kept.items():
        torch.testing.assert_close(value, head.state_dict()[name])


def _tally(tokens: int, seconds: float, rounds: int, hits: int = 0, misses: int = 0) -> Tally:
    tally = Tally()
    stats = Stats(rounds, 0, 0, [], [], 0.0, 0.0, 0.0, hits, misses, 0, 0, False)
    tally.add(list(range(tokens)), seconds, stats)
    return tally


def test_the_ratio_row_puts_pipelined_over_sequential_beside_its_bound() -> None:
    """Draft 30 ms and verify 60 ms per round: the bound is 90 / 60 = 1.5; 20 vs 10 tokens/s is 2.0, 1.33 of it."""
    row = summarise(_tally(100, 10.0, 50), _tally(100, 5.0, 50, hits=30, misses=20), draft_s=1.5, verify_s=3.0)
    assert (row["draft_ms_per_round"], row["verify_ms_per_round"], row["draft_over_verify"]) == (30.0, 60.0, 0.5)
    assert row["pipelined_over_sequential"] == 2.0 and row["bound"] == 1.5
    assert row["of_bound"] == pytest.approx(1.333, abs=1e-3) and row["hit_rate"] == 0.6
