"""``specdec distill`` ranks checkpoints on held-out prompts of every category it trains on, and on those alone when
its data cache holds other held-out rows (:func:`specdec.distill.command.collect_data`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdec.distill.command import collect_data
from specdec.distill.prompts import load_prompt_set
from tests.tiny_models import smollm2

CATEGORY_OF = {record.id: record.category for record in load_prompt_set("heldout")}


def held_out_categories(data_dir: Path, categories: str, count: int) -> list[str]:
    args = argparse.Namespace(
        data=None, categories=categories, held_out_prompts=count, responses_per_prompt=1, seed=0,
        max_tokens=3, batch_size=4, data_minutes=0.0,
    )  # fmt: skip
    _, held_out = collect_data(smollm2(), args, data_dir, fused=False, dtype=torch.float32)
    return sorted(CATEGORY_OF[example.id] for example in held_out)


def test_held_out_prompts_take_the_chosen_categories_in_turn_and_only_they_are_read(tmp_path: Path) -> None:
    assert held_out_categories(tmp_path, "chat,code,maths,qa", 4) == ["chat", "code", "maths", "qa"]
    assert held_out_categories(tmp_path, "rewrite,qa", 3) == ["qa", "rewrite", "rewrite"]  # not the 4 cached before
