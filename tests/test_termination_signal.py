"""Services stop on SIGTERM even when the kernel hands the signal to a thread other than the main one.

Python runs signal handlers only in the main thread; a process-directed signal may land on any thread (gRPC's,
gloo's, torch's). A main thread parked in an untimed ``Event.wait()`` is then never woken to run the handler, and
the process serves on until it is killed: a tensor-parallel verifier rank ignored its SIGTERM that way once in a
while (``tests/test_supervise.py``). The script below sends SIGTERM to one of its own non-main threads, which makes
the loss deterministic: with ``Event.wait()`` in place of :meth:`TerminationSignal.wait` it never prints ``stopped``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import signal, threading, time
    from grpc_common.server import TerminationSignal

    termination = TerminationSignal(poll_s=0.05)

    def signal_this_thread():
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # lands here, not on the main thread
        time.sleep(60)

    threading.Thread(target=signal_this_thread, daemon=True).start()
    termination.wait()
    print("stopped", flush=True)
    """
)


def test_a_sigterm_delivered_to_another_thread_ends_the_wait() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "stopped\n"
