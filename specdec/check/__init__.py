"""``specdec check``: a statistical certificate that a live deployment's speculation is lossless.

:mod:`specdec.check.stats` holds the statistics (pure functions over counts), :mod:`specdec.check.runner` the
procedure against a router, :mod:`specdec.check.backends` the two front doors (gRPC SDK, HTTP API), and
:mod:`specdec.check.command` the subcommand.
"""
