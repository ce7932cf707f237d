"""Which pre-drafted proposal a verdict selects (pipelining, DESIGN §4): chains and trees, one outcome or several.

While the verifier checks proposal k (sent with ``defer_bonus``), the drafter pre-drafts on the assumption that the
proposal's ``assumed_path`` (a chain: all of it; a tree: the root-to-leaf path of its most probable leaf) is
accepted; with multi-outcome pre-drafting (the drafter's ``predraft_outcomes`` > 1, Saguaro / "speculative
speculative decoding") it also drafts a proposal for each of proposal k's ``rejections``: the first ``j`` nodes of
that path accepted, then the draft's most likely correction. The verdict selects (:func:`select`):

* ``"full"``: the bonus was deferred and the accepted path *is* the assumed path. The verifier kept ``p(γ+1)`` at
  the leaf instead of drawing a bonus, and the pre-draft hangs off that leaf: its first token is verified against
  the kept row exactly as a fresh round's first token would be.
* ``"rejection"``: the verdict emitted exactly one guessed rejection's tokens (accepted prefix and correction).
  The verifier drew that correction itself from the residual ``norm(max(0, p − q))`` with its own random numbers;
  the guess did not influence it, it only chose which proposal was ready for the text that resulted.
* ``"miss"``: anything else (a rejection elsewhere or with another correction, another leaf's path accepted with
  the bonus deferred). The pre-draft is cancelled in the drafter without waiting for it (the Commit of the verdict
  carries ``cancel_through``), and the next round drafts afresh; after a deferred bonus on another leaf the fresh
  proposal, or a target step, starts from the kept row.

Why every outcome is lossless: a pre-draft is only a proposal. Each was drawn from the ``q`` it carries given the
text it hangs off, with the drafter's random numbers, which are independent of the verifier's; it is used only when
that text is exactly the committed text; and every token committed is accepted or drawn by the verifier's rule.
The selection depends only on the committed verdict, never on the proposal's own tokens, so it cannot bias them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from router.errors import WorkerError
    from router.pipeline import Drafted, Verified

Outcome = Literal["full", "rejection", "miss"]


@dataclass(frozen=True)
class PreDraft:
    """A pre-draft in flight: the drafter call (its result: the proposal, the drafter's failure, or None when the
    request had no drafter left), its ``propose_id``, which a Commit's ``cancel_through`` names, and ``committed``,
    set once the drafter has acknowledged the Commit sent before it (the next Commit waits for that, never for the
    proposal)."""

    task: asyncio.Task[Drafted | WorkerError | None]
    propose_id: int
    committed: asyncio.Event


def select(drafted: Drafted, verified: Verified) -> tuple[Outcome, int]:
    """The outcome of the verdict on ``drafted`` for its pre-draft, and for ``"rejection"`` the index of the matching
    entry of ``drafted.rejections`` (else -1).

    With ``drafted.assumed_path == (0, 1)`` and ``rejections == ((5, 8), (7,))``: accepted ``(0, 1)`` with the bonus
    deferred is ``("full", -1)``; emitted ``(7,)`` is ``("rejection", 1)``; emitted ``(5, 9)`` is ``("miss", -1)``.
    """
    if verified.bonus_deferred:
        return ("full", -1) if tuple(verified.accepted_path) == drafted.assumed_path else ("miss", -1)
    emitted = tuple(verified.emitted)
    for index, guess in enumerate(drafted.rejections):
        if emitted == guess:
            return "rejection", index
    return "miss", -1


def selected(outcome: Outcome, index: int, predrafted: Drafted) -> Drafted | None:
    """The proposal the outcome selects from the pre-draft's answer (None: none, the pre-draft was cut short)."""
    if outcome == "full":
        return predrafted
    if outcome == "rejection" and index < len(predrafted.outcomes):
        return predrafted.outcomes[index]
    return None
