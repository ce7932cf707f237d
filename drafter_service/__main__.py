"""``python -m drafter_service``: serve a drafter until SIGTERM / SIGINT.

Prints one JSON line, ``{"address": "HOST:PORT", "kind": KIND}`` (plus ``"metrics": "HOST:PORT"`` with
``--metrics-port``), on stdout once it serves; logs go to stderr. Exit status 0 after a graceful stop, 2 when
the configuration or a model is bad.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence

from drafter_service.config import DrafterConfig
from drafter_service.server import start_drafter_process
from grpc_common.server import TerminationSignal
from specdec.errors import SpecdecError


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        running = start_drafter_process(DrafterConfig.from_args(argv))
    except (SpecdecError, ValueError) as error:  # a bad flag, env value or model
        print(f"drafter_service: {error}", file=sys.stderr)
        return 2
    termination = TerminationSignal()
    ready = {"address": running.address, "kind": running.config.kind}
    if running.metrics_address is not None:
        ready["metrics"] = running.metrics_address
    print(json.dumps(ready), flush=True)
    termination.wait()
    logging.getLogger(__name__).info("stopping (grace %.1fs)", running.config.grace_s)
    running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
