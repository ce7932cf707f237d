"""bench.overhead's own arithmetic (no stack started): the router's CPU clock, the bound and the report."""

from __future__ import annotations

import os

from bench.load.simulate import LatencySpec, SimulationConfig
from bench.overhead import add_bound, markdown, variants
from bench.services import process_cpu_s


def test_process_cpu_is_read_from_proc_and_grows_with_work() -> None:
    before = process_cpu_s(os.getpid())
    total = 0
    while process_cpu_s(os.getpid()) == before:  # one clock tick of work, whatever the tick
        total += sum(range(10_000))
    assert process_cpu_s(os.getpid()) > before > 0


def test_the_bound_is_the_slower_side_over_the_committed_tokens_per_round() -> None:
    rows = [{"tokens_per_round": 3.0, "mean_tpot_ms": 6.0}, {"tokens_per_round": None, "mean_tpot_ms": None}]
    add_bound(rows, LatencySpec("uniform", 1.0, 3.0), LatencySpec("const", 15.0))
    assert rows[0]["bound_ms_per_token"] == 5.0 and rows[0]["bound_ratio"] == 5.0 / 6.0
    assert rows[1]["bound_ms_per_token"] is None and rows[1]["bound_ratio"] is None
    row = {
        "streams": 8,
        "event_loop": "uvloop",
        "arrival_wait": 0.25,
        "transport": "stream",
        "gc": "server",
        "rounds": 10,
        "router_cpu_ms_per_round": 0.5,
        "router_cpu_fraction": 0.1,
        "router_overhead_ms_p50": 1.0,
        "router_overhead_ms_p99": 2.0,
        "verifier_queue_ms_p50": 0.5,
        "verifier_queue_ms_p99": None,
        "drafter_queue_ms_p50": 0.25,
        "drafter_queue_ms_p99": 0.75,
        "requests_per_s": 3.0,
        "tokens_per_round": 3.0,
        "failed": 0,
        "median_tpot_ms": 6.0,
        "pipeline_hit_rate": None,
        **rows[0],
    }
    document = {
        "name": "t",
        "date": "2026-01-01T00:00:00Z",
        "command": ["python", "-m", "bench.overhead"],
        "environment": {"cpu": "cpu", "cpus": 2, "load_average": [1.0, 1.0, 1.0], "versions": {}},
        "config": {
            "note": "",
            "draft_latency": "const:1",
            "verify_latency": "const:2",
            "verify_per_seq_ms": 0.0,
            "bound_draft_latency": "uniform:1,3",
            "bound_verify_latency": "const:15",
        },
        "overhead": [row],
        "bound": [row],
    }
    text = markdown(document)
    assert "| 8 | uvloop | 0.25 | stream | server | . | 10 | 0.500 |" in text
    assert "| 0.10 | 4.00 | 1.00 / 2.00 | 0.50 / – | 0.25 / 0.75 |" in text  # burst: 8 streams × 0.5 ms
    assert "| 5.00 | 6.00 (6.00) | 0.83 |" in text


def test_every_combination_of_the_axes_is_one_stack_with_its_gc_policy_and_router_code() -> None:
    configs = variants(SimulationConfig(), ["uvloop"], [1.0], ["stream", "unary"], ["server", "default"], ["", "/b"])
    assert len(configs) == 8
    unary_default = configs["uvloop-wait1-unary-gcdefault-."]
    assert unary_default.gc_policy == "default" and not unary_default.worker_streams
    assert unary_default.router_source is None and configs["uvloop-wait1-stream-gcserver-/b"].router_source == "/b"


def test_a_note_stays_out_of_the_recorded_command() -> None:
    from bench.load.report import elide_option

    assert elide_option(["--duration", "5", "--note", "long text", "--name", "x"], "--note") == [
        "--duration",
        "5",
        "--note",
        "…",
        "--name",
        "x",
    ]
    assert elide_option(["--note=long"], "--note") == ["--note=…"]
