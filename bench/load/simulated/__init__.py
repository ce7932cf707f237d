"""Simulated drafter and verifier workers: the real gRPC protocol with no model behind it.

``python -m bench.load.simulated --role {drafter,verifier}`` serves the real ``specdec.v1.Drafter`` or
``specdec.v1.Verifier`` service (plus ``grpc.health.v1``) on a ``grpc.aio`` server, so one process holds hundreds
of concurrent calls while it sleeps instead of computing; :mod:`bench.load.simulate` starts a router over them.

- :mod:`.verifier`: the acceptance law and the real verifier's budget / ``defer_bonus`` rules.
- :mod:`.drafter`: proposals in the real drafter's shapes and wire format.
- :mod:`.device`: one simulated device per process, batching calls like the real schedulers.
- :mod:`.server`: the gRPC servicers and the process's serve loop; :mod:`.config` its options.

**Determinism.** Each sequence's decisions come from a numpy generator seeded by the Open request's seed alone,
so a request replays the same tokens and verdicts whatever else runs; ``--seed`` drives the latency draws.
"""
