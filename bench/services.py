"""Start the specdec services as plain subprocesses on 127.0.0.1 (no Ray), for benchmarks.

Each service prints one JSON line on stdout once it serves (``{"address": ...}`` for workers,
``{"grpc": ..., "http": ...}`` for the router). :meth:`Services.spawn` starts a process without
waiting, so several models load at once; :meth:`Service.wait_ready` waits for that line.
:class:`Services` stops everything it started, last first: SIGTERM, then SIGKILL if a process
does not exit in time. Each service's stderr goes to ``LOG_DIR/NAME.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


def process_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads) so far, in seconds, from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15 of proc(5)


def service_env(extra: Mapping[str, str] | None = None, source: Path = ROOT) -> dict[str, str]:
    """The environment for a service: this one, offline hub, ``source`` (the checkout it runs from, by default this
    repository) first on ``PYTHONPATH``, then ``extra``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    return env


@dataclass
class Service:
    """One service process; ``ready`` is the JSON line it printed once serving (empty until then)."""

    name: str
    process: subprocess.Popen
    log_path: Path
    ready: dict = field(default_factory=dict)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict:
        """Wait for the ready line; raises RuntimeError (with the log's tail) if it does not come."""
        if self.ready:
            return self.ready
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if selector.select(min(left, 0.5)):
                    line = self.process.stdout.readline()
                    if line:
                        self.ready = json.loads(line)
                        return self.ready
                    break  # EOF: the process is exiting
                if self.process.poll() is not None:
                    break
        tail = self.log_path.read_text(errors="replace")[-2000:]
        status = self.process.poll()
        why = f"exited with status {status}" if status is not None else f"not ready within {timeout_s:.0f} s"
        raise RuntimeError(f"{self.name} {why} (log {self.log_path}):\n{tail}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit status."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


class Services:
    """The services a benchmark started; a context manager that stops them all (last started first)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Service] = []

    def spawn(
        self, name: str, module: str, args: list[str], env: Mapping[str, str] | None = None, source: Path = ROOT
    ) -> Service:
        """Start ``python -m module *args`` (``env``: variables set on top of :func:`service_env`'s; ``source``: the
        checkout whose code it runs, e.g. a worktree of another commit, to compare two in one run) without waiting
        for it to serve."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=source,
                env=service_env(env, source),
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        service = Service(name, process, log_path)
        self.started.append(service)
        return service

    def start(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        timeout_s: float = READY_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> Service:
        """Start a service and wait until it serves."""
        service = self.spawn(name, module, args, env)
        service.wait_ready(timeout_s)
        return service

    def stop(self) -> None:
        while self.started:
            self.started.pop().stop()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
