"""The workers' arrival wait (or the router's worker transport) on the real stack: concurrent streams with two
settings, interleaved.

Two stacks run side by side on 127.0.0.1, each a ``python -m verifier_service``, a ``python -m drafter_service``
(``--drafter-kind``) and a ``python -m router``. They differ only in what ``--compare`` names: ``arrival-wait``,
the workers' ``--arrival-wait`` 0 (a forward starts with whatever has arrived) or ``--arrival-wait`` (default 1,
:mod:`grpc_common.arrivals`); ``transport``, the router's batches as unary RPCs (``--no-worker-streams``) or on one
stream per worker (the default, :mod:`router.calls`). Each step sends
one wave of ``--streams`` concurrent requests through the SDK, one request per stream and all the same length
(``ignore_eos``, ``--max-tokens``), to one stack. Speculation modes, then stacks in alternating order, are
interleaved over ``--repeats``, so drifting machine load hits both alike. Only one stack works at a time.

Reported per stack and mode: output tokens/s of a wave (all tokens / first send to last finish), and the
verifier's forwards, mean batch, mean forward time and mean wait before a forward (its ``/metrics``: the
``specdec:verifier_batch_size``, ``_forward_seconds`` and ``_arrival_wait_seconds`` histograms over the wave).
Every wave's greedy outputs, of both stacks and every mode, must agree token for token. Writes ``NAME.json`` and
``NAME.md``.

    python -m bench.arrival_wait --streams 8 --max-tokens 48 --repeats 2
    python -m bench.arrival_wait --compare transport --name transport
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.load.metrics import Sample, counter_total, histogram_mean, metrics_delta, scrape
from bench.load.report import run_metadata, write_report
from bench.services import Service, Services
from specdec.client import Client

PROMPTS = Path(__file__).resolve().parent / "prompts" / "colocated.jsonl"
MODES = ("off", "sequential", "pipelined")


def verifier_metrics(verifier: Service) -> list[Sample]:
    return asyncio.run(scrape(f"http://{verifier.ready['metrics']}/metrics"))


def wave(clients: Sequence[Client], verifier: Service, prompts: Sequence[str], options: dict[str, Any]) -> dict:
    """One request per client at once; tokens/s of the wave and what the verifier did meanwhile."""
    before = verifier_metrics(verifier)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        results = list(pool.map(lambda pair: pair[0].generate(pair[1], **options), zip(clients, prompts, strict=True)))
    elapsed = time.perf_counter() - started
    delta = metrics_delta(before, verifier_metrics(verifier))
    forwards = counter_total(delta, "specdec:verifier_batch_size_count") or 0.0
    wait_s = histogram_mean(delta, "specdec:verifier_arrival_wait_seconds")
    forward_s = histogram_mean(delta, "specdec:verifier_forward_seconds")
    return {
        "tokens_per_s": sum(len(result.token_ids) for result in results) / elapsed,
        "forwards": forwards,
        "mean_batch": histogram_mean(delta, "specdec:verifier_batch_size"),
        "mean_forward_ms": None if forward_s is None else 1e3 * forward_s,
        "mean_wait_ms": None if wait_s is None else 1e3 * wait_s,
        "token_ids": [list(result.token_ids) for result in results],
    }


def settings(compare: str, arrival_wait: float) -> dict[str, tuple[list[str], list[str]]]:
    """The two compared settings by label: (extra worker flags, extra router flags)."""
    if compare == "transport":
        return {"unary": ([], ["--no-worker-streams"]), "stream": ([], [])}
    return {f"wait {wait:g}": (["--arrival-wait", f"{wait:g}"], []) for wait in (0.0, arrival_wait)}


def start_stack(
    services: Services, label: str, flags: tuple[list[str], list[str]], args: argparse.Namespace
) -> dict[str, Service]:
    (wait, router_flags), name = flags, label.replace(" ", "")
    threads = ["--torch-threads", "1"]
    verifier = services.spawn(
        f"verifier-{name}",
        "verifier_service",
        ["--model", args.target, "--dtype", "float32", "--metrics-port", "0", *threads, *wait],
    )
    drafter = services.spawn(
        f"drafter-{name}", "drafter_service", ["--kind", args.drafter_kind, "--target", args.target, *threads, *wait]
    )
    addresses = ["--verifier", verifier.wait_ready()["address"], "--drafter", drafter.wait_ready()["address"]]
    router = services.start(
        f"router-{name}",
        "router",
        ["--model", args.target, "--grpc-port", "0", "--http-port", "0", *addresses, *router_flags],
    )
    return {"verifier": verifier, "drafter": drafter, "router": router}


def markdown(document: dict[str, Any]) -> str:
    config = document["config"]
    lines = [
        f"# bench.arrival_wait {document['name']}",
        "",
        f"{document['date']} · {document['environment']['cpu']} ({document['environment']['cpus']} CPUs) · "
        f"specdec {document['environment']['versions'].get('specdec_commit')}",
        "",
        f"Command: `{' '.join(document['command'])}`. {config['streams']} concurrent streams, one request each, "
        f"{config['max_tokens']} tokens (ignore_eos), greedy, drafter `{config['drafter_kind']}`, one torch thread "
        f"per worker; {config['compare']}: {' vs '.join(config['settings'])}, interleaved over {config['repeats']} "
        "repeats. "
        f"Greedy outputs identical in every wave (both stacks, every mode): "
        f"**{'yes' if document['identical'] else 'NO'}**.",
        "",
        "| mode | setting | tokens/s by repeat | tokens/s median | verifier forwards | mean batch "
        "| mean forward ms | mean wait ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in document["rows"]:
        waves = row["waves"]
        rates = [w["tokens_per_s"] for w in waves]
        lines.append(
            f"| {row['mode']} | {row['setting']} | {', '.join(f'{r:.1f}' for r in rates)} | "
            f"{statistics.median(rates):.1f} | {statistics.mean(w['forwards'] for w in waves):.0f} | "
            f"{statistics.mean(w['mean_batch'] or 0 for w in waves):.2f} | "
            f"{statistics.mean(w['mean_forward_ms'] or 0 for w in waves):.1f} | "
            f"{statistics.mean(w['mean_wait_ms'] or 0 for w in waves):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.arrival_wait", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter-kind", default="ngram")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare", choices=("arrival-wait", "transport"), default="arrival-wait")
    parser.add_argument("--arrival-wait", type=float, default=1.0, help="the compared wait (against 0)")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="arrival-wait")
    args = parser.parse_args(argv)

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows[: args.streams]]
    if len(prompts) < args.streams:
        parser.error(f"--streams: {PROMPTS.name} has only {len(prompts)} prompts")
    options = {"chat": True, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    compared = settings(args.compare, args.arrival_wait)
    results: dict[tuple[str, str], list[dict]] = {(mode, label): [] for mode in MODES for label in compared}
    with tempfile.TemporaryDirectory(prefix="bench-arrival-wait-") as logs, Services(Path(logs)) as services:
        stacks = {label: start_stack(services, label, flags, args) for label, flags in compared.items()}
        clients = {
            label: [Client(stack["router"].ready["grpc"], timeout_s=600) for _ in range(args.streams)]
            for label, stack in stacks.items()
        }
        try:
            step = 0
            for repeat in range(args.repeats + 1):  # the first pass warms both stacks up and is not counted
                for mode in MODES:
                    order = list(compared) if step % 2 == 0 else list(reversed(compared))
                    step += 1
                    for label in order:
                        mode_options = {**options, "speculation": mode, "drafter": args.drafter_kind}
                        measured = wave(clients[label], stacks[label]["verifier"], prompts, mode_options)
                        if repeat:
                            results[(mode, label)].append(measured)
                        print(json.dumps({"mode": mode, "stack": label, "tokens_per_s": measured["tokens_per_s"]}))
        finally:
            for stack_clients in clients.values():
                for client in stack_clients:
                    client.close()
    outputs = [wave["token_ids"] for waves in results.values() for wave in waves]
    config = {key: value for key, value in vars(args).items() if key not in ("result_dir", "name")}
    config["settings"] = list(compared)
    document = run_metadata(args.name, ["python", "-m", "bench.arrival_wait", *(argv or sys.argv[1:])], config)
    document["identical"] = all(output == outputs[0] for output in outputs)
    document["rows"] = [
        {
            "mode": mode,
            "setting": label,
            "waves": [{key: value for key, value in w.items() if key != "token_ids"} for w in waves],
        }
        for (mode, label), waves in results.items()
    ]
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
