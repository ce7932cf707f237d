"""Long prompts in ``specdec distill``: the data keeps the feature rows of each example's training window alone, the
batches train an example's last head positions (its response and the end of its prompt, as serving's window sees
them), and prefills are admitted a bounded number of prompt tokens at a time without changing any example."""

from __future__ import annotations

import torch

from specdec.distill.data import Example, feature_window_start, generate_examples
from specdec.distill.train import make_batches
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams
from tests.tiny_models import tiny_llama


def test_a_long_example_trains_its_last_head_positions_from_the_rows_it_keeps() -> None:
    length, prompt_length, window, hidden = 50, 40, 16, 4
    tokens = torch.arange(100, 100 + length, dtype=torch.int32)
    rows = torch.randn(length - 1, hidden, generator=torch.Generator().manual_seed(0)).half()
    start = feature_window_start(length, window)
    assert start == length - 2 - window
    whole = Example("whole", tokens, prompt_length, rows)
    kept = Example("kept", tokens, prompt_length, rows[start:], None, start)
    (from_whole,) = make_batches([whole], 4096, window)
    (from_kept,) = make_batches([kept], 4096, window)
    for name in ("tokens", "inputs", "targets", "positions", "loss_mask"):
        torch.testing.assert_close(getattr(from_kept, name), getattr(from_whole, name))
    # head positions L-1-window .. L-2: each reads its token and the row before it and predicts its own row
    positions = from_kept.positions[0].tolist()
    assert positions == list(range(length - 1 - window, length - 1))
    assert from_kept.tokens[0].tolist() == tokens[positions[0] : length - 1].tolist()
    torch.testing.assert_close(from_kept.inputs[0], rows[positions[0] - 1 : length - 2])
    torch.testing.assert_close(from_kept.targets[0], rows[positions[0] : length - 1])
    assert from_kept.loss_mask[0].tolist() == [p + 1 >= prompt_length for p in positions]


def test_a_short_example_trains_every_head_position() -> None:
    rows = torch.randn(9, 4, generator=torch.Generator().manual_seed(1)).half()
    example = Example("short", torch.arange(10, dtype=torch.int32), 6, rows)
    assert feature_window_start(10, 16) == 0
    (batch,) = make_batches([example], 4096, 16)
    assert batch.positions[0].tolist() == list(range(1, 9))
    torch.testing.assert_close(batch.inputs[0], rows[:8])


def test_long_prompts_keep_their_windows_rows_and_bounded_prefills_change_no_example() -> None:
    model = tiny_llama(seed=3, vocab_size=16, max_positions=1024).model
    generator = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(0, 15, (size,), generator=generator).tolist()) for i, size in
               enumerate([700, 12, 30, 660, 5])]  # fmt: skip

    def examples(prefill_tokens: int) -> dict[str, Example]:
        made = generate_examples(
            KVRunner(model),
            frozenset(),
            prompts,
            max_tokens=6,
            batch_size=8,
            sampling_for=lambda index: SamplingParams(temperature=0.0 if index % 2 else 0.8),
            seed=5,
            prefill_tokens=prefill_tokens,
        )
        return {example.id: example for example in made}

    together, one_at_a_time = examples(100_000), examples(1)
    assert set(together) == {prompt_id for prompt_id, _ in prompts}
    runner = KVRunner(model)
    for prompt_id, example in together.items():
        other = one_at_a_time[prompt_id]
        assert example.token_ids.tolist() == other.token_ids.tolist()
        torch.testing.assert_close(example.features, other.features, atol=1e-3, rtol=1e-3)
        text = example.token_ids.tolist()
        start = feature_window_start(len(text))
        assert example.features_start == start and (start > 0) == (len(text) > 642)
        sequence = runner.open()
        _, (rows,) = runner.forward_features([ForwardItem(sequence, text)], (runner.num_layers,))
        runner.close(sequence)
        torch.testing.assert_close(example.features.float(), rows[start:-1].float(), atol=2e-3, rtol=2e-3)
