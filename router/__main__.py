"""``python -m router --model smollm2-135m --drafter HOST:PORT --verifier HOST:PORT ...``

Prints one JSON line ``{"grpc": ADDRESS, "http": ADDRESS, "model": NAME}`` once both servers accept requests,
then serves until SIGTERM or SIGINT, on which it drains gracefully (``--shutdown-grace-s``). A bad
configuration exits with status 2 and one line naming the option.
"""

from __future__ import annotations

import json
import logging
import sys

from grpc_common.server import TerminationSignal
from router.config import RouterConfig
from router.server import start_router_process
from specdec.errors import SpecdecError


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig.from_args(argv)
        router = start_router_process(config)
    except (SpecdecError, OSError) as error:
        print(f"router: error: {error}", file=sys.stderr)
        return 2
    termination = TerminationSignal()
    print(json.dumps({"grpc": router.grpc_address, "http": router.http_address, "model": config.model}), flush=True)
    termination.wait()
    router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
