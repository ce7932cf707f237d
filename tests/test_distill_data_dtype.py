"""``specdec distill`` has the target write its training data in bfloat16 where that runs faster, and its held-out
data (what ranks checkpoints) as loaded; the head trains under bfloat16 autocast where that runs faster:
:mod:`specdec.distill.dtypes` and the data stage."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specdec.distill.command
from specdec.cache import distill_data_dir
from specdec.cli import main
from specdec.distill.data import generate_examples, read_shards
from specdec.distill.dtypes import generation_dtype, training_dtype
from specdec.errors import InvalidArgumentError
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from tests.tiny_models import SMOLLM2, smollm2, tiny_llama


def unmeasured(_: object) -> float:
    raise AssertionError("a named dtype is not measured")


@pytest.mark.parametrize(
    ("choose", "field", "threshold"),
    [(generation_dtype, "data_dtype", 1.5), (training_dtype, "train_dtype", 1.2)],
    ids=["data", "training"],
)
def test_auto_picks_bfloat16_only_where_it_runs_at_least_the_thresholds_times_faster(
    choose: Callable[..., torch.dtype], field: str, threshold: float
) -> None:
    model = tiny_llama(seed=0).model
    assert choose("auto", model, speedup=lambda _: 0.57) is torch.float32  # a Xeon without AMX
    assert choose("auto", model, speedup=lambda _: threshold - 0.01) is torch.float32
    assert choose("auto", model, speedup=lambda _: threshold) is torch.bfloat16
    assert choose("float32", model, speedup=unmeasured) is torch.float32
    assert choose("bfloat16", model, speedup=unmeasured) is torch.bfloat16
    with pytest.raises(InvalidArgumentError, match=f"{field}: must be one of auto, float32, bfloat16"):
        choose("float16", model)


def final_rows_in_float32(runner: KVRunner, token_ids: torch.Tensor) -> torch.Tensor:
    """The target's final-norm rows of positions ``0 .. L - 2`` of ``token_ids``, teacher-forced in one forward."""
    (example,) = generate_examples(
        runner,
        frozenset(),
        [("check", token_ids.tolist())],
        max_tokens=1,
        batch_size=1,
        sampling_for=lambda _: SamplingParams(temperature=0.0),
        seed=0,
    )
    return example.features[: len(token_ids) - 1].float()


def test_training_data_comes_from_a_bfloat16_copy_and_held_out_data_from_the_target_as_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(specdec.distill.command, "load_model", lambda name, **_: smollm2())
    argv = ["distill", "--target", SMOLLM2, "--data-dtype", "bfloat16", "--data-minutes", "0.15", "--max-tokens", "6",
            "--held-out-prompts", "2", "--batch-size", "4", "--steps", "1", "--draft-vocab", "256",
            "--fp32", "--out", str(tmp_path / "head")]  # fmt: skip
    status = main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0
    assert summary["data_dtype"] == "bfloat16"
    assert summary["train_dtype"] == "float32"  # --fp32: --train-dtype float32
    # the prompt-lookup tail measured on the held-out rows is kept with the head, for the drafter that serves it
    head_config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert head_config["specdec_lookup_min_match"] == summary["lookup_min_match"]
    assert set(summary["lookup_tokens_per_round"]) == {str(size) for size in range(9)}
    exact = KVRunner(smollm2().model)
    data = distill_data_dir(SMOLLM2)
    held_out, train = read_shards(data / "heldout"), read_shards(data / "train")
    assert len(held_out) == 2 and train
    for example in held_out:  # float32 rows, up to float16 storage and the shapes of the forwards that made them
        rows = example.features.float()
        torch.testing.assert_close(rows, final_rows_in_float32(exact, example.token_ids), atol=0.02, rtol=0.01)
    for example in train[:4]:  # the same target in bfloat16: near the float32 rows, yet not them
        rows, expected = example.features.float(), final_rows_in_float32(exact, example.token_ids)
        assert (rows - expected).abs().max() > 0.1
        assert F.cosine_similarity(rows, expected, dim=-1).min() > 0.99
