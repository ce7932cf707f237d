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

import torch

from drafter_service.config import DrafterConfig
from drafter_service.server import start_drafter
from grpc_common.server import TerminationSignal
from specdec import gc_policy
from specdec.errors import SpecdecError


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = DrafterConfig.from_args(argv)
        gc_policy.choice_from()  # a bad SPECDEC_GC fails before the model loads
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        running = start_drafter(config)
    except (SpecdecError, ValueError) as error:  # a bad flag, env value or model
        print(f"drafter_service: {error}", file=sys.stderr)
        return 2
    gc_policy.settle(thresholds=None)  # frozen, but passes as often as CPython makes them: short ones
    termination = TerminationSignal()
    ready = {"address": running.address, "kind": config.kind}
    if running.metrics_address is not None:
        ready["metrics"] = running.metrics_address
    print(json.dumps(ready), flush=True)
    termination.wait()
    logging.getLogger(__name__).info("stopping (grace %.1fs)", config.grace_s)
    running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
