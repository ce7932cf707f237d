"""gRPC drafter worker: one process serves many sequences, batching their Propose calls (DESIGN §1, §4, §5).

``python -m drafter_service --kind {ngram,model,early-exit,eagle} --target NAME ...`` serves standalone;
:func:`start_drafter` serves in-process (tests, co-located deployments).
"""

from drafter_service.config import DrafterConfig
from drafter_service.server import RunningDrafter, start_drafter

__all__ = ["DrafterConfig", "RunningDrafter", "start_drafter"]
