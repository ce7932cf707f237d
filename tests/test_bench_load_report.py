"""The files of ``specdec bench``: JSON valid against bench/load/schema.json, every DESIGN §7 row in the Markdown,
hardware/versions/date labels, PNG charts, the sweep files with the target QPS (synthetic runs, no server)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from bench.load.report import SCHEMA_PATH, compact_json, run_metadata, section7_rows, write_results
from bench.load.summary import Slo, summarize
from bench.load.sweep import Point
from tests.test_bench_load_summary import synthetic_run

SECTION7 = (
    "tokens committed per round",
    "drafted tokens",
    "acceptance rate (accepted / drafted)",
    "mean accepted length (1 + accepted / rounds)",
    "acceptance by position",
    "draft ms / round",
    "verify ms / round",
    "state-refresh ms / round",
    "TTFT ms median / p95",
    "ITL ms median / p95",
    "e2e latency ms median / p95",
    "output tokens/s",
    "completed requests/s",
    "errors (timeouts)",
    "completion rate",
    "input tokens min / median / p95 / max",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def meta() -> dict:
    return run_metadata("test", ["specdec", "bench", "--qps", "1.5"], {"backend": "grpc", "max_tokens": 16})


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def point(rate: float, mode: str, slower: float = 1.0, failure: bool = True) -> Point:
    """The synthetic run at ``rate`` in ``mode``; without ``failure`` its timed-out request is left out."""
    run = synthetic_run()
    run = replace(
        run,
        records=run.records if failure else run.records[:-1],
        spec=replace(run.spec, qps=rate),
        options=replace(run.options, speculation=mode),
        duration_s=run.duration_s * slower,
        label=f"qps{rate:g}-{mode}",
    )
    summary = summarize(run, Slo(ttft_ms=250, itl_ms=600))
    summary["saturation"] = None
    return run, summary


def test_single_point_files(tmp_path: Path, meta: dict, validator: jsonschema.Draft202012Validator) -> None:
    markdown, written = write_results(tmp_path, "one", [point(1.5, "pipelined")], meta, slo=Slo(ttft_ms=250))
    names = sorted(path.name for path in written)
    assert names == sorted(["one.json", "one.md", "one-latency-cdf.png", "one-acceptance.png", "one-round-split.png"])
    document = json.loads((tmp_path / "one.json").read_text())
    validator.validate(document)
    assert document["kind"] == "point" and len(document["requests"]) == 4  # the warm-up and the failure kept
    assert document["requests"][3]["error"]["kind"] == "deadline_exceeded"
    assert document["completed"] == 2 and document["p95_itl_ms"] == pytest.approx(480)
    assert markdown == (tmp_path / "one.md").read_text()
    for row in SECTION7:
        assert f"| {row}" in markdown, row
    env = meta["environment"]
    for label in (meta["date"], env["cpu"], "python", "torch", "transformers", "grpcio", "specdec_commit"):
        assert label in markdown
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 1000


def test_section7_rows_fill_values() -> None:
    rows = dict(section7_rows(summarize(synthetic_run())))
    assert rows["acceptance rate (accepted / drafted)"] == "0.450"
    assert rows["mean accepted length (1 + accepted / rounds)"] == "2.80"
    assert rows["errors (timeouts)"] == "1 (1): deadline_exceeded 1"
    assert rows["TTFT ms median / p95"] == "150.0 / 195.0"


def test_sweep_files(tmp_path: Path, meta: dict, validator: jsonschema.Draft202012Validator) -> None:
    points = [point(1, "off", failure=False), point(1, "pipelined", failure=False)]
    points += [point(2, "off", slower=3.0), point(2, "pipelined", failure=False)]
    points[2][1]["saturation"] = "window outlasted the schedule"
    stopped = {"off": "after qps2-off: window outlasted the schedule"}
    slo = Slo(ttft_ms=250, itl_ms=600)
    markdown, written = write_results(tmp_path, "sw", points, meta, slo=slo, stopped=stopped)
    names = {path.name for path in written}
    assert {"sw-sweep.json", "sw-sweep.md", "sw-sweep-throughput.png", "sw-sweep-p95-itl.png"} <= names
    assert {f"sw-qps{q}-{m}.json" for q in (1, 2) for m in ("off", "pipelined")} <= names
    document = json.loads((tmp_path / "sw-sweep.json").read_text())
    validator.validate(document)
    for path in tmp_path.glob("sw-qps*.json"):
        validator.validate(json.loads(path.read_text()))
    # p95 TTFT 195 ms ≤ 250 and p95 ITL 480 ms ≤ 600 everywhere; off failed a request at 2 QPS
    assert document["target_qps"] == {"off": 1, "pipelined": 2}
    assert document["stopped"] == stopped and len(document["points"]) == 4
    assert "Target QPS" in markdown and "off stopped after qps2-off" in markdown
    assert markdown.count("\n| 1 |") == 2 and markdown.count("\n| 2 |") == 2


def test_schema_rejects_a_missing_key(meta: dict, validator: jsonschema.Draft202012Validator, tmp_path: Path) -> None:
    write_results(tmp_path, "bad", [point(1, "off")], meta, plots=False)
    document = json.loads((tmp_path / "bad.json").read_text())
    del document["p95_ttft_ms"]
    assert not validator.is_valid(document)


def test_compact_json_is_one_line_with_microsecond_floats() -> None:
    text = compact_json({"itls": [0.1234567891, 2.0], "nested": {"x": (1e-7, 3)}, "name": "a"})
    assert text.count("\n") == 1 and text.endswith("\n")
    assert json.loads(text) == {"itls": [0.123457, 2.0], "nested": {"x": [0.0, 3]}, "name": "a"}
