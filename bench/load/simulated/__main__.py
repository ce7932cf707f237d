"""``python -m bench.load.simulated --role {drafter,verifier} ...``: one simulated worker process.

Logs go to stderr so that stdout carries only the ready line :mod:`bench.services` waits for; a bad option
exits 2 with a one-line message instead of a traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from bench.load.simulated.config import WorkerConfig
from bench.load.simulated.server import serve
from specdec import eventloop


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = WorkerConfig.from_args(argv)
    except ValueError as error:
        print(f"bench.load.simulated: {error}", file=sys.stderr)
        return 2
    eventloop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
