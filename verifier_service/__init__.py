"""The verifier service: a gRPC server around :class:`specdec.verification.BatchVerifier` (DESIGN §2, §5).

``config`` (one frozen config), ``scheduler`` (the one thread that owns the model and batches Verify calls),
``servicer`` (thin proto ↔ core), ``server`` (wiring and lifecycle), ``tensor_parallel`` (the target sharded over
ranks, rank 0 serving), ``__main__`` (``python -m verifier_service``).
"""
