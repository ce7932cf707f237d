"""The maths of ``specdec bench`` against hand-computed numbers: percentile, TPOT/ITL, the summary, goodput,
histogram quantiles from Prometheus buckets, metrics deltas, saturation and target QPS."""

from __future__ import annotations

import numpy as np
import pytest

from bench.load.metrics import histogram_buckets, histogram_quantile, metrics_delta, parse_metrics
from bench.load.records import RequestError, RequestRecord
from bench.load.runner import LoadRun, LoadSpec
from bench.load.summary import Slo, meets_slo, percentile, summarize
from bench.load.sweep import saturation, target_qps
from bench.load.workload import RequestOptions


def speculation(rounds: int, drafted: int, accepted: int, per_position: list[int], draft: float, verify: float) -> dict:
    return {
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "accepted_per_position": per_position,
        "draft_s": draft,
        "verify_s": verify,
        "state_s": draft,
        "pipeline_hits": 0,
        "pipeline_misses": 0,
        "wire_bytes": 100 * rounds,
        "drafter_fallback": False,
    }


def synthetic_run() -> LoadRun:
    """Two completed requests, one timed-out, one warm-up; a 2 s window."""
    records = [
        RequestRecord(0, "w", "chat", 0.0, 0.3, ttft_s=0.1, chunk_times_s=[0.1], prompt_tokens=99, output_tokens=1,
                      finish_reason="stop", speculation=speculation(1, 4, 4, [1, 1, 1, 1], 1.0, 1.0), warmup=True),
        RequestRecord(0, "p0", "chat", 0.0, 1.0, scheduled_s=0.0, ttft_s=0.2, chunk_times_s=[0.2, 0.5, 1.0],
                      prompt_tokens=10, output_tokens=9, finish_reason="length",
                      speculation=speculation(3, 12, 6, [3, 2, 1], 0.03, 0.3)),
        RequestRecord(1, "p1", "code", 0.5, 1.5, scheduled_s=0.5, ttft_s=0.1, chunk_times_s=[0.1, 0.4],
                      prompt_tokens=20, output_tokens=5, finish_reason="stop",
                      speculation=speculation(2, 8, 3, [2, 1], 0.02, 0.2)),
        RequestRecord(2, "p2", "chat", 1.0, 2.0, scheduled_s=1.0,
                      error=RequestError("deadline_exceeded", "no answer within 1.0 s")),
    ]  # fmt: skip
    spec = LoadSpec(qps=1.5, num_requests=3, warmup_requests=1)
    return LoadRun(spec, RequestOptions(speculation="sequential"), "grpc", records, 2.0, label="qps1.5")


def test_percentile_is_numpys_linear() -> None:
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)  # h = 3·0.95 = 2.85 → 3 + 0.85·(4 − 3)
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([10], 99) == 10
    assert percentile([], 50) is None
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (0, 1, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_record_itl_and_tpot() -> None:
    record = synthetic_run().records[1]
    assert record.itl_s == pytest.approx([0.3, 0.5])
    assert record.tpot_s == pytest.approx(0.1)  # (1.0 − 0.2) / (9 − 1)
    assert RequestRecord(0, "x", "c", 0.0, 1.0, ttft_s=0.5, output_tokens=1).tpot_s is None


def test_summary_numbers() -> None:
    s = summarize(synthetic_run())
    assert (s["num_prompts"], s["warmup_requests"], s["completed"], s["failed"], s["timeouts"]) == (3, 1, 2, 1, 1)
    assert s["completion_rate"] == pytest.approx(2 / 3)
    assert s["errors"] == ["deadline_exceeded: no answer within 1.0 s"]
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 14)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 7.0 and s["total_token_throughput"] == 22.0
    # TTFT 200, 100 ms
    assert (s["mean_ttft_ms"], s["median_ttft_ms"], s["std_ttft_ms"]) == pytest.approx((150, 150, 50))
    assert (s["p95_ttft_ms"], s["p99_ttft_ms"]) == pytest.approx((195, 199))
    # ITL: every chunk gap pooled, 300, 500, 300 ms → sorted 300, 300, 500; p95: h = 1.9 → 300 + 0.9·200
    assert (s["mean_itl_ms"], s["median_itl_ms"], s["p95_itl_ms"]) == pytest.approx((1100 / 3, 300, 480))
    # TPOT 100 ms and (1.0 − 0.1) / 4 = 225 ms
    assert (s["mean_tpot_ms"], s["median_tpot_ms"]) == pytest.approx((162.5, 162.5))
    assert (s["mean_e2el_ms"], s["p99_e2el_ms"]) == pytest.approx((1000, 1000))
    assert s["input_len_stats"] == {"min": 10, "median": 15, "p95": pytest.approx(19.5), "max": 20}
    assert s["category_counts"] == {"chat": 2, "code": 1}
    assert s["input_lens"] == [10, 20] and s["output_lens"] == [9, 5] and s["ttfts"] == [0.2, 0.1]
    assert s["schedule_span_s"] == 1.0


def test_summary_speculation_rows() -> None:
    s = summarize(synthetic_run())  # the warm-up's perfect acceptance is excluded
    assert (s["num_rounds"], s["draft_tokens"], s["accepted_tokens"]) == (5, 20, 9)
    assert s["acceptance_rate"] == pytest.approx(0.45)
    assert s["mean_accepted_length"] == pytest.approx(2.8)  # 1 + 9/5
    assert s["tokens_per_round"] == pytest.approx(2.8)  # 14 output tokens / 5 rounds
    assert s["accepted_per_position"] == [5, 3, 1]
    assert s["acceptance_by_position"] == pytest.approx([1.0, 0.6, 0.2])
    # per round: draft (30 + 20)/5 = 10 ms, verify 100, state 10, wall (1000 + 1000)/5 = 400, other 280
    assert (s["draft_ms_per_round"], s["verify_ms_per_round"], s["state_ms_per_round"]) == pytest.approx((10, 100, 10))
    assert (s["wall_ms_per_round"], s["other_ms_per_round"]) == pytest.approx((400, 280))
    assert s["wire_bytes_per_round"] == 100 and s["pipeline_hit_rate"] is None
    assert s["num_drafts"] is None and s["router_overhead_ms_p50"] is None  # no metrics scraped


def test_goodput() -> None:
    run = synthetic_run()
    first, second = run.records[1], run.records[2]
    # TTFT ≤ 150 ms: only the second (100 ms); its one ITL gap, 300 ms, is within 400
    assert not meets_slo(first, Slo(ttft_ms=150, itl_ms=400)) and meets_slo(second, Slo(ttft_ms=150, itl_ms=400))
    assert summarize(run, Slo(ttft_ms=150, itl_ms=400))["request_goodput"] == 0.5  # 1 good request / 2 s
    # per-request p95 ITL of the first: 300 + 0.95·200 = 490 ms > 450
    assert not meets_slo(first, Slo(itl_ms=450)) and meets_slo(first, Slo(itl_ms=490))
    # TPOT 100 and 225 ms
    assert meets_slo(first, Slo(tpot_ms=150)) and not meets_slo(second, Slo(tpot_ms=150))
    assert not meets_slo(run.records[3], Slo())  # failed requests are never good
    assert summarize(run)["request_goodput"] is None


def test_histogram_quantile() -> None:
    buckets = [(0.001, 2.0), (0.005, 6.0), (0.01, 9.0), (float("inf"), 10.0)]
    # q=0.5: rank 5 lies in (0.001, 0.005] holding 4 observations, 3 of them below the rank → 0.001 + 0.004·3/4
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.004)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.0005)  # rank 1 of 2 in [0, 0.001]
    assert histogram_quantile(0.99, buckets) == 0.01  # rank 9.9 in +Inf: the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.5, []) is None


EXPOSITION = """\
# TYPE specdec:router_overhead_seconds histogram
specdec:router_overhead_seconds_bucket{le="0.001",model_name="m"} {b1}
specdec:router_overhead_seconds_bucket{le="0.005",model_name="m"} {b2}
specdec:router_overhead_seconds_bucket{le="+Inf",model_name="m"} {b3}
specdec:router_overhead_seconds_count{model_name="m"} {b3}
specdec:router_overhead_seconds_sum{model_name="m"} 0.1
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} {drafts}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} {running}
"""


def exposition(b1: int, b2: int, b3: int, drafts: int, running: int) -> str:
    values = {"{b1}": b1, "{b2}": b2, "{b3}": b3, "{drafts}": drafts, "{running}": running}
    text = EXPOSITION
    for key, value in values.items():
        text = text.replace(key, str(value))
    return text


def test_metrics_delta_and_router_overhead() -> None:
    before = parse_metrics(exposition(5, 5, 5, 100, 3))
    after = parse_metrics(exposition(7, 9, 10, 130, 1))
    delta = metrics_delta(before, after)
    assert histogram_buckets(delta, "specdec:router_overhead_seconds") == [(0.001, 2), (0.005, 4), (float("inf"), 5)]
    values = {s.name: s.value for s in delta if not s.name.endswith("_bucket")}
    assert values["vllm:spec_decode_num_drafts_total"] == 30 and values["vllm:num_requests_running"] == 1  # gauge
    run = synthetic_run()
    run.metrics = delta
    s = summarize(run)
    assert s["num_drafts"] == 30
    # p50: rank 2.5 in (0.001, 0.005] holding 2, 0.5 above its start → 0.001 + 0.004·0.25 = 2 ms; p99 → +Inf → 5 ms
    assert (s["router_overhead_ms_p50"], s["router_overhead_ms_p99"]) == pytest.approx((2.0, 5.0))
    assert s["verifier_queue_ms_p50"] is None  # a router that does not export the series


def test_saturation_rule() -> None:
    point = {"failed": 0, "request_rate": 2.0, "median_e2el_ms": 1000.0, "duration": 12.0, "schedule_span_s": 10.0}
    assert saturation(point) is None  # 12 − 1 = 11 s ≤ 10 / 0.8 = 12.5 s
    assert "schedule span" in saturation({**point, "duration": 15.0})  # 14 s > 12.5 s
    assert saturation({**point, "failed": 2}) == "2 failed request(s)"
    assert saturation({**point, "duration": 99.0, "request_rate": "inf"}) is None


def test_target_qps() -> None:
    def point(rate: float, ttft: float, itl: float, failed: int = 0) -> dict:
        return {"request_rate": rate, "p95_ttft_ms": ttft, "p95_itl_ms": itl, "failed": failed}

    points = [point(1, 100, 50), point(2, 150, 80), point(4, 900, 70), point(8, 100, 60, failed=3)]
    assert target_qps(points, Slo(ttft_ms=200, itl_ms=100)) == 2
    assert target_qps(points, Slo(itl_ms=100)) == 4  # 8 QPS had failures
    assert target_qps(points, Slo(itl_ms=75)) == 4  # the highest within, even above a violating point
    assert target_qps(points, Slo(ttft_ms=50)) is None
