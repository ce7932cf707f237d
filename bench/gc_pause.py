"""What one full garbage collection costs a serving process, under CPython's default and after
:func:`specdec.gc_policy.settle` (``SPECDEC_GC=server``).

For each ``--roles`` entry a fresh Python process imports what that service imports and loads what it serves with
(router: its server module and the tokenizer; verifier: its server module and the target model), then reports the
objects the collector tracks and the median time of ``gc.collect()`` (every generation), before and after
``settle("server")``. A full pass stops the whole process, the event loop included: in a
verifier it lands between forwards, in a router on every stream's next round. Writes ``NAME.json`` / ``NAME.md``.

    python -m bench.gc_pause --roles router,verifier --model smollm2-135m
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.load.report import run_metadata, write_report

ROLES = ("router", "verifier")


def _build(role: str, model: str) -> None:
    """Import and load what ``role``'s process holds once it serves."""
    if role == "router":
        import router.server  # noqa: F401  (the router's imports: grpc, aiohttp, transformers)
        from specdec.model_files import load_tokenizer

        load_tokenizer(model)
    else:
        import verifier_service.server  # noqa: F401
        from specdec.models import load_model

        load_model(model)


def _median_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(role: str, model: str, repeats: int) -> dict[str, Any]:
    """In this process: build ``role``, then time collections before and after the server policy."""
    from specdec import gc_policy

    _build(role, model)
    row: dict[str, Any] = {"role": role}
    for policy in ("default", "server"):
        if policy == "server":
            gc_policy.settle("server")
        row[policy] = {"tracked_objects": len(gc.get_objects()), "full_ms": _median_ms(repeats)}
    row["frozen_objects"] = gc.get_freeze_count()
    return row


def markdown(document: dict[str, Any]) -> str:
    lines = [
        f"# bench.gc_pause {document['name']}",
        "",
        f"{document['date']} · {document['environment']['cpu']} · model {document['config']['model']}",
        "",
        f"Command: `{' '.join(document['command'])}`",
        "",
        "| process | policy | objects the collector tracks | full collection ms (median) |",
        "|---|---|---|---|",
    ]
    for row in document["rows"]:
        for policy in ("default", "server"):
            cell = row[policy]
            lines.append(f"| {row['role']} | {policy} | {cell['tracked_objects']} | {cell['full_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gc_pause", description=__doc__.split("\n\n")[0])
    parser.add_argument("--roles", default=",".join(ROLES), help="comma-separated: router, verifier")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", choices=ROLES, help=argparse.SUPPRESS)  # the child process's role
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="gc-pause")
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.model, args.repeats)))
        return 0
    roles = [role.strip() for role in args.roles.split(",") if role.strip()]
    for role in roles:
        if role not in ROLES:
            parser.error(f"--roles: unknown role {role!r} (choose from {', '.join(ROLES)})")
    rows = []
    for role in roles:
        child = [sys.executable, "-m", "bench.gc_pause", "--measure", role, "--model", args.model]
        child += ["--repeats", str(args.repeats)]
        completed = subprocess.run(child, capture_output=True, text=True, check=True, timeout=600)
        rows.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    command = ["python", "-m", "bench.gc_pause", *(argv if argv is not None else sys.argv[1:])]
    document = run_metadata(args.name, command, {"model": args.model, "repeats": args.repeats})
    document["rows"] = rows
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
