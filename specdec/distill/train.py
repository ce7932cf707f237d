"""Training an EAGLE head (:mod:`specdec.drafters.eagle_head`) on self-distillation examples.

Per example (prompt + response, ``L`` tokens, target features ``F_0 .. F_(L-2)``) the head reads, at head
position ``i = 1 .. L-2``, the token ``t_i`` and the feature ``F_(i-1)`` (a fused head: the fused rows ``A_(i-1)``
through its ``fc``), and its output (the row its LM head reads, :meth:`~EagleHead.output`) is trained towards
``F_i``:

- **soft cross-entropy** to the target's law of ``t_(i+1)`` over the draft vocabulary, ``softmax(lm_head(F_i))``
  (the target's own LM-head rows, so this is the target's distribution restricted to the K draft tokens);
- **feature regression**: smooth L1 between the head's output and ``F_i`` (weight ``feature_weight``);
- **training-time unrolling** (EAGLE-3's "training-time test"): step ``s`` feeds the head its own step ``s-1``
  states as input features (what drafting feeds a drafted row), with the attention it would have at drafting depth ``s``
  (:func:`unrolled_mask`); step losses are weighted ``step_decay ** s``.

Losses count only positions that predict a response token, so a prompt's rows (but the last ``unroll_steps``) only
give the others their keys and values: the head's last layer runs its queries, output projection and MLP on the
rows from there on (:func:`query_rows`), and the unrolled steps run on those rows alone. On the demo's data (prompt
rows ~40 % of all) that made steps 1.09-1.15x as fast at one unrolled step and 1.21-1.27x at three, the states of the
loss rows unchanged. Batches group examples of similar length (right padding: causal attention never lets a real row
see a pad). The learning rate warms up, then follows a cosine over the run, measured in steps (``steps``) or in
elapsed time (``minutes``).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.distill.data import Example
from specdec.drafters.eagle_head import HEAD_CONTEXT, EagleHead, gather_rows, scaled_attention
from specdec.errors import InvalidArgumentError
from specdec.sampling import argmax

CHECKPOINT_FILE = "train-state.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; ``steps`` or ``minutes`` bounds the run (the first reached ends it)."""

    steps: int | None = None
    minutes: float | None = None
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_tokens: int = 3072
    max_length: int = HEAD_CONTEXT
    unroll_steps: int = 3
    step_decay: float = 0.8
    feature_weight: float = 0.2
    eval_every: int = 100
    seed: int = 0
    bf16: bool = True  # bfloat16 autocast: same head quality, faster where the hardware has it (distill.dtypes)

    def __post_init__(self) -> None:
        if self.steps is None and self.minutes is None:
            raise InvalidArgumentError("steps", "give steps or minutes to bound training")
        if self.unroll_steps < 1:
            raise InvalidArgumentError("unroll_steps", f"must be >= 1, got {self.unroll_steps}")


@dataclass(frozen=True)
class Batch:
    """Right-padded rows: ``tokens`` [B, T], ``inputs`` [B, T, W] (the target rows read: ``F_(i-1)``, or the
    fused ``A_(i-1)``), ``targets`` [B, T, H] (``F_i``), ``positions`` [B, T], ``loss_mask`` [B, T] (rows that
    predict a response token), ``context``: per row, the tokens of its text before the window (the first token, and
    a long text's start; prompt lookup reads them, as serving's lookup reads the whole text). Rows are stored in half
    precision (a large data set stays in memory): raw layer rows in bfloat16, final-norm rows in float16."""

    tokens: torch.Tensor
    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    loss_mask: torch.Tensor
    target_top: torch.Tensor | None = None  # [R] (held-out batches): see :func:`with_target_argmax`
    target_token: torch.Tensor | None = None  # [R] (held-out batches): the target's argmax token at each loss row
    context: tuple[torch.Tensor, ...] = ()  # per row (() in a batch made by hand: none)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass(frozen=True)
class EvalResult:
    """Teacher-forced agreement on held-out rows: ``agree[s]`` is the fraction of response rows where the head's
    argmax at unroll step ``s`` equals the target's (over the target's whole vocabulary for batches
    :func:`with_target_argmax` made, as greedy drafting meets it); ``loss`` the weighted training loss."""

    loss: float
    agree: tuple[float, ...]


def choose_draft_vocab(examples: Sequence[Example], size: int, vocab_size: int, keep: Sequence[int]) -> torch.Tensor:
    """The ``size`` most frequent response tokens of ``examples`` (ties: lower id), always including ``keep``
    (EOS), as sorted target ids [K]. Tokens never seen fill the rest by id order when the data is small."""
    if not 1 <= size <= vocab_size:
        raise InvalidArgumentError("draft_vocab", f"must be in [1, {vocab_size}] (the target's vocabulary), got {size}")
    counts: Counter[int] = Counter()
    for example in examples:
        counts.update(example.token_ids[example.prompt_length :].tolist())
    chosen = [int(token) for token in keep if 0 <= token < vocab_size][:size]
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    chosen_set = set(chosen)
    for token in [*ranked, *range(vocab_size)]:
        if len(chosen) >= size:
            break
        if token not in chosen_set:
            chosen.append(token)
            chosen_set.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def make_batches(
    examples: Sequence[Example], batch_tokens: int, max_length: int, *, fused: bool = False
) -> list[Batch]:
    """Examples grouped by length into batches of at most ``batch_tokens`` padded rows, each example's last
    ``max_length`` head positions (a long prompt's start is left out, as serving's window leaves it out:
    :data:`~specdec.drafters.eagle_head.HEAD_CONTEXT`); ``fused``: the inputs are the examples' fused rows (an
    EAGLE-3 head)."""
    if fused and any(e.fused is None for e in examples):
        raise InvalidArgumentError("data", "a fused head needs examples with fused rows (regenerate the data)")
    sized = sorted(((_window(e, max_length)[1], e) for e in examples), key=lambda pair: pair[0])
    batches, group = [], []
    for length, example in sized:
        if length < 1:
            continue
        if group and (len(group) + 1) * length > batch_tokens:
            batches.append(_collate(group, max_length, fused))
            group = []
        group.append(example)
    if group:
        batches.append(_collate(group, max_length, fused))
    return batches


def _window(example: Example, max_length: int) -> tuple[int, int]:
    """The first head position and the number of head positions an example trains: the last ``max_length`` of
    ``1 .. L - 2`` whose input rows (one position before) it holds."""
    size = min(len(example.token_ids) - 2 - example.features_start, max_length)
    return len(example.token_ids) - 1 - size, size


def _collate(examples: list[Example], max_length: int, fused: bool) -> Batch:
    length = max(_window(e, max_length)[1] for e in examples)
    hidden = examples[0].features.shape[-1]
    width = examples[0].fused.shape[-1] if fused else hidden
    count = len(examples)
    tokens = torch.zeros(count, length, dtype=torch.long)
    inputs_dtype = torch.bfloat16 if fused else torch.float16  # raw layer rows need bfloat16's range
    inputs = torch.zeros(count, length, width, dtype=inputs_dtype)
    targets = torch.zeros(count, length, hidden, dtype=torch.float16)
    loss_mask = torch.zeros(count, length, dtype=torch.bool)
    positions = torch.arange(1, length + 1).repeat(count, 1)
    context = []
    for row, example in enumerate(examples):
        first, size = _window(example, max_length)  # head positions first .. first + size - 1
        context.append(example.token_ids[:first].clone())  # a copy: a view would keep the shard file mapped
        row_of = first - 1 - example.features_start  # the stored row of F_(first - 1)
        tokens[row, :size] = example.token_ids[first : first + size].long()
        inputs[row, :size] = (example.fused if fused else example.features)[row_of : row_of + size]
        targets[row, :size] = example.features[row_of + 1 : row_of + 1 + size]
        positions[row] += first - 1
        loss_mask[row, :size] = positions[row, :size] + 1 >= example.prompt_length  # predicts t_(i+1) of the response
    return Batch(tokens, inputs, targets, positions, loss_mask, context=tuple(context))


def with_target_argmax(batches: Sequence[Batch], lm_head: torch.Tensor, draft_ids: torch.Tensor) -> list[Batch]:
    """``batches`` with ``target_token``: at every loss row the argmax of the target's whole LM head (``lm_head``
    [V, H] over the ``targets`` rows), and ``target_top``: that token as an index into ``draft_ids``, or -1 when it
    is outside them.

    Agreement measured against the argmax of the draft vocabulary's rows alone counts a row whose target token the
    draft vocabulary lacks as agreed whenever the head picks the best token it has; drafting can never propose that
    token, so greedy verification rejects it there. Held-out agreement (what the progress bar reports and the best
    head is chosen by) counts such a row as a miss. One pass over the held-out rows, in chunks of ``_ARGMAX_ROWS``.
    """
    index_of = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
    index_of[draft_ids] = torch.arange(len(draft_ids))
    weight = lm_head.detach().float()
    marked = []
    for batch in batches:
        rows = batch.targets[batch.loss_mask]
        top = [argmax(chunk.float() @ weight.T) for chunk in rows.split(_ARGMAX_ROWS)]
        tokens = torch.cat(top) if top else index_of[:0]
        marked.append(replace(batch, target_top=index_of[tokens], target_token=tokens))
    return marked


_ARGMAX_ROWS = 512  # rows per [rows, V] logits block: 100 MB at SmolLM2's 49 152 tokens


def unrolled_mask(length: int, step: int) -> torch.Tensor:
    """Visibility of the keys of steps ``0 .. step`` to step ``step``'s queries, bool [T, (step + 1) * T].

    At drafting depth ``s`` the row at position ``i`` sees the committed head positions up to ``i - s`` (their
    keys were made from true features: step 0) and, for each depth ``s' = 1 .. s``, the drafted row at
    ``i - s + s'`` (made at step ``s'``; ``s' = s`` is the row itself, so no row is empty). Example,
    ``length = 3, step = 1`` (columns: the step-0 keys, then the step-1 keys)::

        [0, 0, 0,  1, 0, 0]
        [1, 0, 0,  0, 1, 0]
        [1, 1, 0,  0, 0, 1]

    Step 0 is the plain causal mask.
    """
    rows = torch.arange(length)[:, None]
    columns = torch.arange(length)[None, :]
    blocks = [columns <= rows - step]
    blocks += [columns == rows - step + depth for depth in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class _UnrolledAttention:
    """Attention for one unroll step: this step's keys join the earlier steps' (per layer), under the layer's mask."""

    def __init__(self, cache: list[list[tuple[torch.Tensor, torch.Tensor]]], masks: Sequence[torch.Tensor]) -> None:
        self.cache = cache
        self.masks = masks

    def __call__(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self.cache[index].append((key, value))
        keys = torch.cat([k for k, _ in self.cache[index]], dim=2)
        values = torch.cat([v for _, v in self.cache[index]], dim=2)
        return scaled_attention(query, keys, values, self.masks[index])


def query_rows(loss_mask: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [B, Q] each unroll step computes, and which of them the loss reads [B, Q].

    The loss reads response rows. At step ``s`` a row ``i`` reads step ``s - 1``'s state at ``i - 1`` and the keys
    of steps ``1 .. s`` at ``i - s + 1 .. i`` (:func:`unrolled_mask`), so the loss depends on rows from ``steps - 1``
    before an example's first response row onwards; earlier rows (the prompt's) give step 0 their keys and values,
    nothing else. A row past an example's last response row repeats row ``T - 1``, outside the loss."""
    length = loss_mask.shape[1]
    columns = torch.arange(length)
    first = torch.where(loss_mask, columns, length).min(dim=1).values.clamp(max=length - 1)
    end = torch.where(loss_mask, columns + 1, 0).max(dim=1).values
    start = (first - (steps - 1)).clamp(min=0)
    width = max(int((end - start).max()), 1)
    index = start[:, None] + torch.arange(width)
    return index.clamp(max=length - 1), loss_mask.gather(1, index.clamp(max=length - 1)) & (index < end[:, None])


def unrolled_forward(head: EagleHead, batch: Batch, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The head's states [B, Q, H] (:meth:`~EagleHead.forward_rows`) at each unroll step ``0 .. steps - 1`` on the
    rows :func:`query_rows` picks, and which of them are ``batch``'s loss rows [B, Q] (the same rows, in order)."""
    index, loss_mask = query_rows(batch.loss_mask, steps)
    cache: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in head.layers]
    outputs = []
    true_features = head.project(batch.inputs.float())
    causal = unrolled_mask(batch.tokens.shape[1], 0)  # step 0: the last layer queries the index's rows, others all
    masks = [causal] * (len(head.layers) - 1) + [_mask_rows(causal, index)]
    predicted = head.forward_rows(batch.tokens, true_features, batch.positions, _UnrolledAttention(cache, masks), index)
    outputs.append(predicted)
    tokens, positions = batch.tokens.gather(1, index), batch.positions.gather(1, index)
    first_features = gather_rows(true_features, index[:, :1])
    for step in range(1, steps):
        # row i reads the last step's state at i - 1 (an index's first row: never the loss's, see query_rows)
        features = torch.cat([first_features, predicted[:, :-1]], dim=1)
        attend = _UnrolledAttention(cache, [_step_mask(index, batch.tokens.shape[1], step)] * len(head.layers))
        predicted = head.forward_rows(tokens, features, positions, attend)
        outputs.append(predicted)
    return outputs, loss_mask


def _mask_rows(mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` [B, Q] of a [T, K] mask, as SDPA's [B, 1, Q, K]."""
    return mask[index][:, None]


def _step_mask(index: torch.Tensor, length: int, step: int) -> torch.Tensor:
    """:func:`unrolled_mask` for step ``step`` on the rows ``index`` [B, Q]: step 0's keys are all ``length`` rows',
    later steps' keys the rows of ``index`` alone (consecutive rows: a key ``k`` rows back is ``k`` columns back)."""
    width = index.shape[1]
    blocks = [_mask_rows(unrolled_mask(length, step)[:, :length], index)]
    local = unrolled_mask(width, step)[:, width:]  # [Q, step * Q]
    blocks.append(local[None, None].expand(index.shape[0], 1, -1, -1))
    return torch.cat(blocks, dim=-1)


def batch_loss(
    head: EagleHead, batch: Batch, config: TrainConfig, *, measure_agreement: bool = False
) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss and, with ``measure_agreement``, per unroll step the fraction of response rows whose
    argmax agrees (an empty list otherwise: training steps skip the argmaxes, ~11 % of a step on a CPU)."""
    states, mask = unrolled_forward(head, batch, config.unroll_steps)
    with torch.no_grad():
        targets = batch.targets[batch.loss_mask].float()  # [R, H], in the order of the states' loss rows
        target = torch.softmax(head.lm_head(targets), dim=-1)  # [R, K]
        target_top = None
        if measure_agreement:
            target_top = argmax(target) if batch.target_top is None else batch.target_top.to(target.device)
    total = torch.zeros(())
    agree = []
    for step, predicted in enumerate(states):
        rows = head.output(predicted[mask])
        logits = head.lm_head(rows)
        cross_entropy = F.cross_entropy(logits, target)  # soft labels: the target's law over the draft vocabulary
        regression = F.smooth_l1_loss(rows, targets.to(rows.dtype))
        total = total + config.step_decay**step * (cross_entropy + config.feature_weight * regression)
        if target_top is not None:
            agree.append(float((argmax(logits) == target_top).float().mean()))
    return total, agree


def evaluate(head: EagleHead, batches: Sequence[Batch], config: TrainConfig) -> EvalResult:
    """Loss and argmax agreement per unroll step over ``batches`` (weighted by response rows)."""
    losses, agree, weights = 0.0, [0.0] * config.unroll_steps, 0
    was_training = head.training
    head.eval()
    with torch.no_grad(), torch.autocast(_device_type(head), dtype=torch.bfloat16, enabled=config.bf16):
        for batch in batches:
            loss, step_agree = batch_loss(head, batch, config, measure_agreement=True)
            count = batch.num_tokens
            losses += float(loss) * count
            agree = [a + s * count for a, s in zip(agree, step_agree, strict=True)]
            weights += count
    head.train(was_training)
    weights = max(weights, 1)
    return EvalResult(losses / weights, tuple(a / weights for a in agree))


def train(
    head: EagleHead,
    batches: Sequence[Batch],
    held_out: Sequence[Batch],
    config: TrainConfig,
    *,
    checkpoint_dir: Path | None = None,
    on_eval: Callable[[int, EvalResult], None] | None = None,
    on_step: Callable[[int, float, int], None] | None = None,
) -> EvalResult:
    """Train ``head`` in place; returns the last held-out evaluation.

    With ``checkpoint_dir`` the optimiser state is saved there every evaluation and a rerun resumes from it.
    ``on_eval(step, result)`` sees every evaluation (the caller keeps the best head); ``on_step(step, loss)``
    every step with its loss and the response tokens trained on so far, resumed runs included (a progress bar).
    """
    if not batches:
        raise InvalidArgumentError("data", "no training examples (every response was empty?)")
    torch.manual_seed(config.seed)
    order_rng = random.Random(config.seed)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    step, spent, seen = 0, 0.0, 0
    state_path = checkpoint_dir / CHECKPOINT_FILE if checkpoint_dir else None
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        try:
            head.load_state_dict(state["head"])
        except RuntimeError as error:  # a head of another layout or size trained here before
            raise InvalidArgumentError(
                "out", f"{state_path} resumes a different head ({str(error).splitlines()[0]}): choose another --out"
            ) from error
        optimiser.load_state_dict(state["optimiser"])
        step, spent, seen = state["step"], state["seconds"], state.get("tokens_seen", 0)
        order_rng.setstate(state["order_rng"])
    head.train()
    started = time.monotonic() - spent
    result = evaluate(head, held_out, config)
    order: list[int] = []
    while not _done(config, step, time.monotonic() - started):
        if not order:
            order = list(range(len(batches)))
            order_rng.shuffle(order)
        batch = batches[order.pop()]
        for group in optimiser.param_groups:
            group["lr"] = _learning_rate(config, step, time.monotonic() - started)
        with torch.autocast(_device_type(head), dtype=torch.bfloat16, enabled=config.bf16):
            loss, _ = batch_loss(head, batch, config)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimiser.step()
        step += 1
        seen += batch.num_tokens
        if on_step is not None:
            on_step(step, float(loss.detach()), seen)
        if step % config.eval_every == 0 or _done(config, step, time.monotonic() - started):
            result = evaluate(head, held_out, config)
            if on_eval is not None:
                on_eval(step, result)
            if state_path is not None:
                torch.save(
                    {
                        "head": head.state_dict(),
                        "optimiser": optimiser.state_dict(),
                        "step": step,
                        "seconds": time.monotonic() - started,
                        "tokens_seen": seen,
                        "order_rng": order_rng.getstate(),
                    },
                    state_path,
                )
    head.eval()
    return result


def _device_type(head: EagleHead) -> str:
    return head.embed_tokens.weight.device.type


def _done(config: TrainConfig, step: int, seconds: float) -> bool:
    return (config.steps is not None and step >= config.steps) or (
        config.minutes is not None and seconds >= config.minutes * 60
    )


def _learning_rate(config: TrainConfig, step: int, seconds: float) -> float:
    """Linear warm-up, then a cosine to 10 % over the run's progress (steps or time, whichever is further)."""
    progress = 0.0
    if config.steps is not None:
        progress = step / config.steps
    if config.minutes is not None:
        progress = max(progress, seconds / (config.minutes * 60))
    warm = min(1.0, (step + 1) / config.warmup_steps)
    return config.learning_rate * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))
