"""``specdec bench`` against an in-process router over both APIs, and failed requests kept as records.

The router is ``test_router_grpc``'s: real gRPC servers around fake workers (the target's greedy choice cycles
through the tokens of a sentence, the drafter is wrong every third token) with the real SmolLM2 tokenizer, so text
and chat prompts go through the router's own templating and detokenization. A few requests at a small QPS over
gRPC and over HTTP/SSE must all complete with the router's token counts; the router's ``/metrics`` delta must
count exactly the measured requests.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from transformers import PreTrainedTokenizerBase

from bench.load.backends import GrpcBackend, HttpBackend
from bench.load.cli import default_prompts
from bench.load.report import SCHEMA_PATH
from bench.load.runner import LoadSpec, run_load
from bench.load.summary import summarize
from bench.load.workload import Prompt, RequestOptions, load_prompts
from specdec.cli import main
from specdec.model_files import load_tokenizer
from tests.test_router_grpc import Stack
from tests.tiny_models import SMOLLM2

MAX_TOKENS = 8
REQUESTS = 6


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(SMOLLM2)


def text_stack(tokenizer: PreTrainedTokenizerBase, **overrides) -> Stack:
    """A router with the SmolLM2 tokenizer over fake workers that repeat a sentence."""
    sentence = tokenizer.encode("A load test streams these words again and again, forever.", add_special_tokens=False)
    next_token = lambda context: sentence[len(context) % len(sentence)]  # noqa: E731
    return Stack(tokenizer=tokenizer, next_token=next_token, model=SMOLLM2, **overrides)


@pytest.fixture(scope="module")
def stack(tokenizer: PreTrainedTokenizerBase) -> Iterator[Stack]:
    stack = text_stack(tokenizer)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def prompts() -> list[Prompt]:
    return load_prompts(default_prompts(), limit=4)


def chat_length(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


@pytest.mark.parametrize(("backend_kind", "speculation"), [("grpc", "pipelined"), ("http", "sequential")])
def test_load_over_both_apis(
    stack: Stack,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    backend_kind: str,
    speculation: str,
) -> None:
    router = stack.router
    backend = (
        GrpcBackend(router.grpc_address, 30)
        if backend_kind == "grpc"
        else HttpBackend(f"http://{router.http_address}", 30)
    )
    options = RequestOptions(max_tokens=MAX_TOKENS, ignore_eos=True, speculation=speculation, num_draft_tokens=3)
    spec = LoadSpec(qps=20.0, num_requests=REQUESTS, warmup_requests=1, seed=4)
    run = asyncio.run(
        run_load(
            backend, prompts, options, spec, progress=False, metrics_urls=[f"http://{router.http_address}/metrics"]
        )
    )
    summary = summarize(run)
    assert (summary["completed"], summary["failed"], summary["warmup_requests"]) == (REQUESTS, 0, 1)
    assert summary["total_output_tokens"] == REQUESTS * MAX_TOKENS
    by_id = {prompt.id: prompt for prompt in prompts}
    measured = run.measured
    assert [r.index for r in measured] == list(range(REQUESTS))
    for record in measured:
        assert record.output_tokens == MAX_TOKENS and record.finish_reason == "length"
        assert record.prompt_tokens == chat_length(tokenizer, by_id[record.prompt_id].text)
        assert record.ttft_s is not None and 0 < record.ttft_s <= record.e2el_s
        assert (
            record.chunk_times_s == sorted(record.chunk_times_s) and len(record.itl_s) == len(record.chunk_times_s) - 1
        )
    assert summary["total_input_tokens"] == sum(r.prompt_tokens for r in measured)
    assert summary["num_rounds"] > 0 and 0 < summary["accepted_tokens"] <= summary["draft_tokens"]
    assert summary["metrics_error"] is None
    assert summary["server"]["vllm:request_success_total"] == REQUESTS  # the warm-up is outside the window
    assert summary["server"]["vllm:spec_decode_num_draft_tokens_total"] == summary["draft_tokens"]
    assert summary["server"]["vllm:spec_decode_num_accepted_tokens_total"] == summary["accepted_tokens"]


@pytest.mark.parametrize("backend_kind", ["grpc", "http"])
def test_failed_requests_are_kept(prompts: list[Prompt], backend_kind: str, unused_port: int) -> None:
    address = f"127.0.0.1:{unused_port}"
    backend = GrpcBackend(address, 1.0) if backend_kind == "grpc" else HttpBackend(f"http://{address}", 1.0)
    spec = LoadSpec(qps=50.0, num_requests=3, seed=1)
    run = asyncio.run(run_load(backend, prompts, RequestOptions(max_tokens=4), spec, progress=False))
    assert len(run.records) == 3 and all(not r.ok for r in run.records)
    summary = summarize(run)
    assert (summary["completed"], summary["failed"], summary["completion_rate"]) == (0, 3, 0.0)
    assert {r.error.kind for r in run.records if r.error} <= {"unavailable", "deadline_exceeded"}
    assert len(summary["errors"]) == 3 and summary["request_throughput"] == 0.0


@pytest.mark.parametrize("backend_kind", ["grpc", "http"])
def test_overload_and_timeouts_are_recorded(
    tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], backend_kind: str
) -> None:
    """One request at a time, 50 ms per verification: a burst of 4 gets refused (429 / RESOURCE_EXHAUSTED), and
    a 0.2 s deadline cuts off requests needing 8 verifications."""
    stack = text_stack(tokenizer, delay_s=0.05, max_concurrent_requests=1)
    try:
        router = stack.router
        for timeout_s, expected in ((30.0, "resource_exhausted"), (0.2, "deadline_exceeded")):
            backend = (
                GrpcBackend(router.grpc_address, timeout_s)
                if backend_kind == "grpc"
                else HttpBackend(f"http://{router.http_address}", timeout_s)
            )
            options = RequestOptions(max_tokens=8, ignore_eos=True, speculation="off", chat=False)
            spec = LoadSpec(qps=float("inf"), num_requests=4, seed=2)
            run = asyncio.run(run_load(backend, prompts, options, spec, progress=False))
            kinds = [r.error.kind for r in run.records if r.error]
            assert len(run.records) == 4 and expected in kinds, kinds
            assert summarize(run)["failed"] == len(kinds)
    finally:
        stack.stop()


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_prompt_file_fields(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "category": "chat", "prompt": "hi"}\n\n{"category": "code", "prompt": "x = 1"}\n')
    assert load_prompts(path) == [Prompt("a", "chat", "hi"), Prompt("p-3", "code", "x = 1")]
    assert load_prompts(path, categories=["code"]) == [Prompt("p-3", "code", "x = 1")]
    with pytest.raises(ValueError):
        load_prompts(path, categories=["missing"])


def test_cli_sweep_off_vs_pipelined(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three requests span 0.1-0.3 s of schedule, which one request slowed by a busy machine outlasts: the saturation
    # rule (tested on its own) would stop a mode on the machine's load, not on the sweep's logic tested here.
    monkeypatch.setattr("bench.load.sweep.saturation", lambda summary: None)
    router = stack.router
    argv = ["bench", "--router", router.grpc_address, "--base-url", f"http://{router.http_address}"]
    argv += ["--qps", "20,10", "--sweep-speculation", "off,pipelined", "--num-requests", "3", "--warmup", "1"]
    argv += ["--max-tokens", "4", "--ignore-eos", "--no-progress", "--result-dir", str(tmp_path), "--name", "s"]
    argv += ["--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"]
    assert main(argv) == 0
    document = json.loads((tmp_path / "s-sweep.json").read_text())
    jsonschema.validate(document, json.loads(SCHEMA_PATH.read_text()))
    labels = [point["label"] for point in document["points"]]
    assert labels == ["qps10-off", "qps10-pipelined", "qps20-off", "qps20-pipelined"]  # rates ascending, interleaved
    assert all(point["completed"] == 3 and point["total_output_tokens"] == 12 for point in document["points"])
    assert document["target_qps"] == {"off": 20, "pipelined": 20} and document["stopped"] == {}
    assert (tmp_path / "s-qps20-pipelined.json").exists() and (tmp_path / "s-sweep-p95-itl.png").exists()
    assert "| 20 | pipelined | 3 / 0 (0) |" in capsys.readouterr().out


def test_a_killed_sweep_keeps_the_points_it_finished(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep cut off (time limit, lost machine) before its final report still leaves each finished point."""
    started: list[str] = []

    async def killed_at_the_third_point(*args, label: str, **kwargs):
        started.append(label)
        if len(started) == 3:
            raise RuntimeError("killed")
        return await run_load(*args, label=label, **kwargs)

    monkeypatch.setattr("bench.load.sweep.run_load", killed_at_the_third_point)
    router = stack.router
    argv = ["bench", "--router", router.grpc_address, "--base-url", f"http://{router.http_address}"]
    argv += ["--qps", "10,20", "--sweep-speculation", "off,pipelined", "--num-requests", "2", "--warmup", "0"]
    argv += ["--max-tokens", "4", "--no-progress", "--result-dir", str(tmp_path), "--name", "k"]
    assert main(argv) != 0
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "k-qps10-off.json",
        "k-qps10-off.md",
        "k-qps10-pipelined.json",
        "k-qps10-pipelined.md",
    ]
    assert json.loads((tmp_path / "k-qps10-pipelined.json").read_text())["completed"] == 2


def test_specdec_cli_import_stays_light() -> None:
    # every subcommand's parser, plugins included: `specdec status` must not wait seconds for torch to import
    code = (
        "import sys; from specdec.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('grpc', 'aiohttp', 'matplotlib', 'torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


def test_cli_finds_the_router_of_specdec_up(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    router = stack.router
    state = {
        "supervisor_pid": 1,
        "status": "ready",
        "routers": [{"grpc": router.grpc_address, "http": router.http_address}],
    }
    monkeypatch.setenv("SPECDEC_STATE_FILE", str(tmp_path / "state.json"))
    (tmp_path / "state.json").write_text(json.dumps(state))
    argv = ["bench", "--backend", "http", "--concurrency", "2", "--num-requests", "4", "--max-tokens", "4"]
    argv += ["--no-progress", "--no-plots", "--result-dir", str(tmp_path), "--name", "up"]
    assert main(argv) == 0
    document = json.loads((tmp_path / "up.json").read_text())
    assert document["completed"] == 4 and document["concurrency"] == 2 and document["metrics_error"] is None
    assert document["config"]["router_http"] == [f"http://{router.http_address}"]
    assert "| load | closed loop, 2 concurrent |" in capsys.readouterr().out


def test_backends_spread_requests_over_several_routers_in_turn() -> None:
    """Request ``i`` goes to router ``i mod N``: gRPC (two scripted routers) and HTTP (two servers that answer 503,
    which the backend records as a failed request)."""
    from aiohttp import web
    from specdec_wire.v1 import router_pb2_grpc

    from grpc_common.server import start_server
    from tests.test_client import ScriptedRouter

    scripted = [ScriptedRouter(), ScriptedRouter()]
    servers = [
        start_server(lambda s, r=r: router_pb2_grpc.add_RouterServicer_to_server(r, s), ["specdec.v1.Router"])
        for r in scripted
    ]
    prompts = [Prompt(f"p{index}", "chat", f"prompt {index}") for index in range(6)]
    hits: list[tuple[int, str]] = []

    async def main() -> None:
        backend = GrpcBackend([server.address for server in servers], timeout_s=10, channels=2)
        async with backend:
            for prompt in prompts:
                assert (await backend.send(prompt, RequestOptions(max_tokens=3))).error is None
        runners, urls = [], []
        for index in range(2):

            async def handle(request: web.Request, index: int = index) -> web.Response:
                hits.append((index, (await request.json())["messages"][0]["content"]))
                return web.Response(status=503, text="busy")

            app = web.Application()
            app.router.add_post("/v1/chat/completions", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        try:
            async with HttpBackend(urls, timeout_s=10) as http:
                for prompt in prompts:
                    assert (await http.send(prompt, RequestOptions(max_tokens=3))).error.kind == "unavailable"
        finally:
            for runner in runners:
                await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        for server in servers:
            server.stop(0)
    sent = [[request.prompt for request in router.requests] for router in scripted]
    assert sent == [["prompt 0", "prompt 2", "prompt 4"], ["prompt 1", "prompt 3", "prompt 5"]]
    assert hits == [(index % 2, f"prompt {index}") for index in range(6)]
