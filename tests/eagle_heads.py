"""EAGLE heads for tests on the real model: trained briefly on the very outputs a test checks, so they accept often.

A head that never accepts would make a greedy-equality test vacuous (every token would be the target's own
correction). :func:`memorised_head` teacher-forces the target over prompt + expected output, trains a one-layer
head on those features for a few dozen steps (seeded) and saves it; its drafts are then mostly right, so the
test exercises acceptances, rejections and the KV that follows them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.distill.data import Example
from specdec.distill.train import TrainConfig, choose_draft_vocab, make_batches, train
from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
from specdec.models import LoadedModel
from specdec.runner import ForwardItem, KVRunner


def memorised_head(
    target: LoadedModel,
    texts: list[tuple[list[int], list[int]]],
    directory: Path,
    steps: int = 60,
    feature_layers: tuple[int, ...] = (),
) -> Path:
    """Train and save (to ``directory``) a head on ``texts`` (prompt ids, output ids); returns ``directory``.
    ``feature_layers``: a fused (EAGLE-3) head reading those layers."""
    runner = KVRunner(target.model)
    hidden = runner.hidden_size
    examples = []
    for index, (prompt, output) in enumerate(texts):
        tokens = prompt + output
        sequence = runner.open()
        _, (rows,) = runner.forward_features([ForwardItem(sequence, tokens)], (*feature_layers, runner.num_layers))
        runner.close(sequence)
        fused = rows[:-1, :-hidden].clone() if feature_layers else None
        examples.append(Example(str(index), torch.tensor(tokens), len(prompt), rows[:-1, -hidden:].clone(), fused))
    vocab = choose_draft_vocab(examples, 1024, target.vocab_size, sorted(target.eos_token_ids))
    torch.manual_seed(0)
    head = EagleHead.from_target(target.model, vocab, feature_layers=feature_layers)
    config = TrainConfig(steps=steps, learning_rate=2e-3, warmup_steps=5, batch_tokens=4096, eval_every=steps)
    batches = make_batches(examples, config.batch_tokens, config.max_length, fused=bool(feature_layers))
    train(head, batches, batches[:1], config)
    save_head(head, directory, HeadInfo(verifier=target.name, num_draft_tokens=4))
    return directory
