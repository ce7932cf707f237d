"""Run inside a private network namespace by tests/test_launcher.py (and tests/test_k8s.py with ``--config FILE``):
up, generate, status, down.

Prints one JSON object: the routers' addresses, greedy token ids per drafter kind and speculation
mode through the SDK (one client over every router, round-robin), the HTTP completion's text (from the first
router), `specdec status --json`, the requests each router finished, and whether `down` removed the deployment.
Without ``--config`` it asks for two routers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import urllib.request

from specdec.client import Client, router_target

PROMPTS = ["Write a Python function that reverses a string.", "Repeat exactly: one two three, one two three."]
MAX_TOKENS = 24


def specdec(*args: str) -> str:
    command = [sys.executable, "-m", "specdec.cli", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {run.returncode}: {run.stderr[-3000:]}")
    return run.stdout


def requests_served(metrics_url: str) -> float:
    """A router's finished requests, from its ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
    return sum(s.value for f in families for s in f.samples if s.name == "vllm:request_success_total")


def main() -> None:
    if sys.argv[1:2] == ["--config"]:  # the deployment of a TOML file (e.g. a Kubernetes overlay's ConfigMap)
        config = sys.argv[2]
        with open(config, "rb") as file:
            kinds = list(tomllib.load(file).get("drafter_kinds", ["ngram"]))
        up_flags = ["--config", config]
    else:
        kinds = sys.argv[1:]
        drafter_flags = [flag for kind in kinds for flag in ("--drafter-kind", kind)]
        up_flags = [*drafter_flags, "--verifier-arg=--torch-threads=1", "--num-routers", "2"]
    up = json.loads(specdec("up", "--num-cpus", "2", *up_flags))
    report: dict = {"up": up, "sdk": {}}
    try:
        with Client(router_target([router["grpc"] for router in up["routers"]]), timeout_s=300) as client:
            for kind in ["none", *kinds]:
                for mode in ("sequential", "pipelined") if kind != "none" else ("off",):
                    outputs = [
                        client.generate(
                            prompt,
                            chat=True,
                            max_tokens=MAX_TOKENS,
                            temperature=0,
                            ignore_eos=True,
                            drafter=kind,
                            speculation=mode,
                        ).token_ids
                        for prompt in PROMPTS
                    ]
                    report["sdk"][f"{kind}/{mode}"] = outputs
        body = json.dumps(
            {
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": PROMPTS[0]}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://{up['routers'][0]['http']}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            report["http_text"] = json.loads(response.read())["choices"][0]["message"]["content"]
        report["status"] = json.loads(specdec("status", "--json"))
        report["served"] = [requests_served(router["metrics"]) for router in up["routers"]]
    finally:
        specdec("down")
    report["state_removed"] = not os.path.exists(os.environ["SPECDEC_STATE_FILE"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
