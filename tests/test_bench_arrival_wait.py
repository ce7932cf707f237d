"""bench.arrival_wait's report (no stack started): a histogram's mean over a wave, and the table."""

from __future__ import annotations

from bench.arrival_wait import markdown
from bench.load.metrics import histogram_mean, metrics_delta, parse_metrics

BEFORE = """\
# TYPE specdec:verifier_batch_size histogram
specdec:verifier_batch_size_count 10
specdec:verifier_batch_size_sum 30
"""
AFTER = """\
# TYPE specdec:verifier_batch_size histogram
specdec:verifier_batch_size_count 14
specdec:verifier_batch_size_sum 60
"""


def test_a_waves_mean_comes_from_the_histograms_growth() -> None:
    delta = metrics_delta(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert histogram_mean(delta, "specdec:verifier_batch_size") == 7.5  # 30 more sequences over 4 more forwards
    assert histogram_mean(delta, "specdec:verifier_arrival_wait_seconds") is None  # absent: nothing to average


def test_the_report_has_one_row_per_mode_and_setting() -> None:
    wave = {"tokens_per_s": 40.0, "forwards": 50, "mean_batch": 7.5, "mean_forward_ms": 140.0, "mean_wait_ms": 0.5}
    document = {
        "name": "t",
        "date": "2026-01-01T00:00:00Z",
        "command": ["python", "-m", "bench.arrival_wait"],
        "environment": {"cpu": "cpu", "cpus": 2, "versions": {}},
        "config": {
            "streams": 8,
            "max_tokens": 48,
            "drafter_kind": "ngram",
            "compare": "arrival-wait",
            "settings": ["wait 0", "wait 1"],
            "repeats": 2,
        },
        "identical": True,
        "rows": [
            {"mode": "off", "setting": "wait 0", "waves": [wave, {**wave, "tokens_per_s": 30.0}]},
            {"mode": "off", "setting": "wait 1", "waves": [wave, wave]},
        ],
    }
    text = markdown(document)
    assert "| off | wait 0 | 40.0, 30.0 | 35.0 | 50 | 7.50 | 140.0 | 0.50 |" in text
    assert "| off | wait 1 | 40.0, 40.0 | 40.0 |" in text and "**yes**" in text and "wait 0 vs wait 1" in text
