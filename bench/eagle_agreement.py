"""Teacher-forced agreement through the served head: does serving compute what training measured?

The target answers each prompt greedily, and one teacher-forced forward over prompt + answer gives its feature rows
(the rows its verdicts carry). The served :class:`~specdec.drafters.eagle.EagleDrafter` then drafts one token at
every answer position from the true rows and text before it, and that token is compared with the target's (its
argmax: the answer is greedy). This is what ``specdec distill`` reports as held-out agreement at depth 1 (measured
there on its own held-out responses, three in four greedy), so a clearly lower number means the head is not served
as it was trained (a layout, feature or vocabulary mismatch).

It is split by whether the previous position agreed. A drafting round starts where the last one ended, mostly at a
rejection, and misses cluster, so a round's first drafted token is accepted less often (``acc@1`` of the
acceptance section) than this average.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.drafters.eagle import EagleDrafter
from specdec.engine import Engine, GenerationRequest
from specdec.models import LoadedModel
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class AgreementTally:
    """Counts of one head's teacher-forced drafts: ``[agreed, positions]`` overall and after an agreed / a missed
    position, and the positions whose target token is outside the draft vocabulary."""

    overall: list[int] = field(default_factory=lambda: [0, 0])
    after_agreed: list[int] = field(default_factory=lambda: [0, 0])
    after_missed: list[int] = field(default_factory=lambda: [0, 0])
    outside_vocab: int = 0

    def row(self) -> dict[str, Any]:
        def share(counts: list[int]) -> float | None:
            return counts[0] / counts[1] if counts[1] else None

        positions = self.overall[1]
        return {
            "positions": positions,
            "agreement": share(self.overall),
            "after_agreed": share(self.after_agreed),
            "after_agreed_positions": self.after_agreed[1],
            "after_missed": share(self.after_missed),
            "after_missed_positions": self.after_missed[1],
            "outside_draft_vocab": self.outside_vocab / positions if positions else None,
        }


def teacher_forced_agreement(
    target: LoadedModel, drafter: EagleDrafter, prompts: Sequence[list[int]], max_tokens: int
) -> AgreementTally:
    """Draft one token at every position of the target's greedy answer to each prompt, from the true features."""
    runner = KVRunner(target.model)
    engine = Engine(runner, target.eos_token_ids)
    draft_vocab = set(drafter.head.draft_to_target.tolist())
    layers = drafter.feature_layers or None  # None: the final norm's rows
    tally = AgreementTally()
    for prompt in prompts:
        [answer] = engine.generate([GenerationRequest(prompt, GREEDY, max_tokens)])
        text = [*prompt, *answer.token_ids]
        sequence = runner.open()
        try:
            _, (features,) = runner.forward_features([ForwardItem(sequence, text)], layers)
        finally:
            runner.close(sequence)
        _tally_answer(drafter, text, len(prompt), features, draft_vocab, tally)
    return tally


def _tally_answer(
    drafter: EagleDrafter,
    text: list[int],
    prompt_length: int,
    features: torch.Tensor,
    draft_vocab: set[int],
    tally: AgreementTally,
) -> None:
    """As a verdict would: the prompt's rows and the first answer token, then at each later position one draft, the
    row before it and the true token (committed as a correction, so the head keeps only true rows)."""
    handle = drafter.open(text[:prompt_length], GREEDY, torch.Generator().manual_seed(0))
    try:
        drafter.add_features(handle, 0, features[:prompt_length])
        drafter.commit(handle, [], [text[prompt_length]])
        previous: bool | None = None
        for position in range(prompt_length + 1, len(text)):
            [proposal] = drafter.propose([handle], [1])
            agreed = len(proposal.tree) > 0 and proposal.tree.tokens[0] == text[position]
            counts = [tally.overall]
            if previous is not None:
                counts.append(tally.after_agreed if previous else tally.after_missed)
            for pair in counts:
                pair[0] += agreed
                pair[1] += 1
            tally.outside_vocab += text[position] not in draft_vocab
            previous = agreed
            drafter.add_features(handle, position - 1, features[position - 1 : position])
            drafter.commit(handle, [], [text[position]])
    finally:
        drafter.close(handle)
