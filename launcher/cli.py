"""``specdec up`` / ``specdec status`` / ``specdec down``: the Ray launcher's command line.

Counts, models and the drafter kind come from flags or one TOML file (``--config``) whose keys
are the :class:`~launcher.cluster.Deployment` field names (``num_drafters = 2``); flags win.
The commands plug into ``specdec`` through the ``specdec.commands`` entry point :func:`register`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

from launcher.cluster import ClusterState, Deployment, TlsDir, health, state_file

UP_TIMEOUT_S = 900
DOWN_TIMEOUT_S = 120


def register(subparsers: argparse._SubParsersAction) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add ``up``, ``status`` and ``down``; return their run functions (a :data:`specdec.cli.Register`)."""
    up = subparsers.add_parser("up", help="start routers, drafters and verifiers on Ray, return when all serve")
    up.add_argument("--address", help="existing Ray cluster (default: start a local one)")
    up.add_argument("--config", type=Path, help="TOML file with any of the options below")
    up.add_argument(
        "--foreground",
        action="store_true",
        help="become the supervisor instead of starting it in the background (a container's main process: "
        "SIGTERM stops the services)",
    )
    up.add_argument("--target", help="target model (default smollm2-135m)")
    up.add_argument(
        "--drafter-kind",
        action="append",
        dest="drafter_kinds",
        choices=("ngram", "model", "early-exit", "eagle"),
        help="drafter kind to place (repeat for several kinds; default ngram)",
    )
    up.add_argument("--draft-model", help="draft model of the model drafter (default: the target)")
    up.add_argument("--eagle-head", help="head directory of eagle drafters (default: the head cached for the target)")
    up.add_argument("--num-drafters", type=int, help="drafters per kind; default 1")
    up.add_argument("--num-verifiers", type=int, help="default 1")
    up.add_argument(
        "--num-routers",
        type=int,
        help="router processes, all sharing every worker; clients spread over their addresses (default 1)",
    )
    up.add_argument("--verifier-gpus", type=int, help="GPUs (tensor-parallel ranks) per verifier; default 0")
    up.add_argument("--num-cpus", type=int, help="CPUs of a local Ray instance (default: all)")
    up.add_argument(
        "--tls-dir",
        type=Path,
        help="serve mutual TLS everywhere with the PEM files in this folder: ca.pem, server.pem, server-key.pem,"
        " client.pem, client-key.pem (see launcher.cluster.TlsDir)",
    )
    for role in ("verifier", "drafter", "router"):
        up.add_argument(f"--{role}-arg", action="append", dest=f"{role}_args", help=f"extra {role} argument")
    status = subparsers.add_parser("status", help="addresses and health of what `up` started")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    subparsers.add_parser("down", help="stop everything `up` started")
    return {"up": _run_up, "status": _run_status, "down": _run_down}


def deployment_from(args: argparse.Namespace) -> Deployment:
    """Defaults, overridden by the TOML file, overridden by explicit flags."""
    values = tomllib.loads(args.config.read_text()) if args.config else {}
    known = {field.name for field in fields(Deployment)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{args.config}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    values.update({name: getattr(args, name) for name in known if getattr(args, name, None) is not None})
    if values.get("tls_dir"):  # absolute: the services start in Ray's working directories, not this one
        tls_dir = TlsDir(Path(values["tls_dir"]).resolve())
        tls_dir.check()
        values["tls_dir"] = str(tls_dir.path)
    return Deployment(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def up(args: argparse.Namespace, path: Path) -> dict:
    """Start the supervisor and wait until it reports the services ready (or failed)."""
    foreground = getattr(args, "foreground", False)
    if path.exists() and not foreground:  # a restarted container's supervisor replaces its predecessor's record
        raise ValueError(f"a deployment is already recorded in {path}; run `specdec down` first")
    command = [sys.executable, "-m", "launcher.daemon", "--state-file", str(path)]
    command += ["--deployment", json.dumps(asdict(deployment_from(args)))]
    if args.address:
        command += ["--address", args.address]
    if args.num_cpus:
        command += ["--num-cpus", str(args.num_cpus)]
    path.parent.mkdir(parents=True, exist_ok=True)
    if foreground:
        os.execv(sys.executable, command)  # never returns
    with open(path.with_suffix(".log"), "ab") as log:
        supervisor = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists():
            state = ClusterState.load(path)
            if state.status == "ready":
                return state.addresses()
            if state.status == "failed":
                supervisor.wait(DOWN_TIMEOUT_S)
                path.unlink(missing_ok=True)
                raise RuntimeError(f"specdec up failed:\n{state.error}")
        if supervisor.poll() is not None:
            raise RuntimeError(f"the supervisor exited ({supervisor.returncode}); see {path.with_suffix('.log')}")
        time.sleep(0.5)
    supervisor.terminate()
    raise TimeoutError(f"services not ready within {UP_TIMEOUT_S} s; see {path.with_suffix('.log')}")


def status(path: Path) -> dict:
    """The deployment's addresses and health; ``router_target`` is the one gRPC target over all its routers."""
    from specdec.client import router_target  # gRPC, as `health` below

    state = ClusterState.load(path)
    return {
        "ray_address": state.ray_address,
        "router_target": router_target([router["grpc"] for router in state.routers]) if state.routers else "",
        "routers": [{**router, "health": health(router["grpc"], state.tls_dir)} for router in state.routers],
        "workers": [{**worker, "health": health(worker["address"], state.tls_dir)} for worker in state.workers],
    }


def down(path: Path) -> None:
    """Signal the supervisor and wait for it to stop everything."""
    state = ClusterState.load(path)
    try:
        os.kill(state.supervisor_pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        return
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    if path.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.supervisor_pid, signal.SIGKILL)
        path.unlink()


def _run_up(args: argparse.Namespace) -> int:
    print(json.dumps(up(args, state_file())))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    report = status(state_file())
    if args.json:
        print(json.dumps(report))
        return 0
    for router in report["routers"]:
        metrics = router.get("metrics", "")
        print(f"router    gRPC {router['grpc']}  HTTP {router['http']}  {router['health']}  {metrics}")
    if len(report["routers"]) > 1:
        print(f"{len(report['routers'])} routers; SDK target over all: {report['router_target']}")
    for worker in report["workers"]:
        print(f"{worker['role']:<9} {worker['address']}  {worker['health']}  {worker.get('metrics', '')}")
    return 0


def _run_down(args: argparse.Namespace) -> int:
    down(state_file())
    return 0
