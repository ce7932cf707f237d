"""`specdec up` / `status` / `down` on an embedded Ray instance, driven through the SDK and HTTP.

Ray addresses its processes by the node's IP; the whole exercise runs in a private network
namespace (``unshare -n`` with only loopback up) so every byte stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import encode_prompt
from specdec.engine import Engine, GenerationRequest
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from tests.launcher_driver import MAX_TOKENS, PROMPTS
from tests.tiny_models import smollm2

ROOT = Path(__file__).resolve().parent.parent


def _can_isolate_network() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def run_isolated_driver(arguments: str, tmp_path: Path, timeout_s: float) -> dict:
    """``tests/launcher_driver.py ARGUMENTS`` in a private network namespace with only loopback up (its state file
    under ``tmp_path``); returns the JSON report it prints."""
    env = {
        **os.environ,
        "SPECDEC_STATE_FILE": str(tmp_path / "cluster.json"),
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(ROOT),
    }
    script = f"ip link set lo up && exec {sys.executable} -m tests.launcher_driver {arguments}"
    run = subprocess.run(
        ["unshare", "-n", "bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not _can_isolate_network(), reason="needs `unshare -n` (root) to keep Ray on loopback")
def test_up_generate_status_down(tmp_path: Path) -> None:
    # two kinds, one with a model and one without: the model drafter (a second 135M model drafting every token on
    # CPU) would add minutes and nothing the launcher does differently for it
    report = run_isolated_driver("ngram early-exit", tmp_path, timeout_s=1500)

    target = smollm2()
    engine = Engine(KVRunner(target.model), target.eos_token_ids)
    requests = [
        GenerationRequest(encode_prompt(target, prompt, chat=True), SamplingParams(0.0), MAX_TOKENS, ignore_eos=True)
        for prompt in PROMPTS
    ]
    expected = [result.token_ids for result in engine.generate(requests)]
    for name, outputs in report["sdk"].items():
        assert outputs == expected, f"{name} differs from co-located target-only greedy"
    assert set(report["sdk"]) == {"none/off"} | {
        f"{k}/{m}" for k in ("ngram", "early-exit") for m in ("sequential", "pipelined")
    }
    assert report["http_text"] == target.tokenizer.decode(expected[0], skip_special_tokens=True)
    routers = report["status"]["routers"]  # two, sharing the workers; the SDK's calls went to both in turn
    assert [r["health"] for r in routers] == ["SERVING"] * 2 and len({r["grpc"] for r in routers}) == 2
    assert report["status"]["router_target"] == "ipv4:" + ",".join(r["grpc"] for r in routers)
    assert sum(report["served"]) == 2 * len(report["sdk"]) + 1 and all(report["served"])
    assert [w["health"] for w in report["status"]["workers"]] == ["SERVING"] * 3
    assert report["state_removed"]
