"""``specdec distill``: train an EAGLE head for a target from the target's own outputs, end to end.

Stages, each resumable (rerunning the same command continues where a killed one stopped):

1. **data** — the target answers the shipped prompt set (:mod:`specdec.distill.prompts`; ``--data FILE`` takes a
   user's own conversations instead, teacher-forced) and the shards land in the cache
   (:func:`~specdec.cache.distill_data_dir`); ``--data-minutes`` bounds this stage, shards already there count;
   ``--responses-per-prompt R`` has the target answer each training prompt R times (all first answers before
   any second one), the answers past the first sampled, for more data than the prompt set's one answer each;
2. **vocabulary** — the ``--draft-vocab`` most frequent response tokens (EOS kept), fixed at the first run;
3. **training** — :func:`specdec.distill.train.train` for ``--steps`` or ``--minutes``, with a progress bar
   (loss, held-out agreement of the head's argmax with the target's at unroll steps 1..S);
4. the head with the best held-out agreement is saved to ``--out`` (default: the cached head ``--drafter eagle``
   uses, :func:`~specdec.cache.default_head_dir`) in the speculators layout;
5. **prompt lookup** — on the held-out rows, the tail match from which a prompt-lookup chain commits more than that
   head's (:mod:`specdec.distill.lookup_choice`), kept in its ``config.json`` for the drafter that serves it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.cache import default_head_dir, distill_data_dir
from specdec.distill.data import (
    Conversation,
    Example,
    ShardWriter,
    encode_chat,
    generate_examples,
    read_conversations,
    read_shards,
    teacher_force_examples,
)
from specdec.distill.dtypes import dtype_name, generation_dtype, model_in_dtype, training_dtype
from specdec.distill.lookup_choice import calibrate_lookup
from specdec.distill.prompts import CATEGORIES, interleave_categories, load_prompt_set
from specdec.distill.train import (
    CHECKPOINT_FILE,
    Batch,
    EvalResult,
    TrainConfig,
    choose_draft_vocab,
    make_batches,
    train,
    with_target_argmax,
)
from specdec.drafters.eagle_head import EagleHead, HeadInfo, eagle3_layers, load_head, save_head, save_head_config
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel, load_model, quiet_model_loading
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams

VOCAB_FILE = "draft-vocab.pt"
SUMMARY_FILE = "train-summary.json"  # what the saved head cost: data, minutes, tokens, held-out agreement


def run_distill(args: argparse.Namespace) -> int:
    """Run ``specdec distill`` (its arguments: :func:`specdec.distill.cli.register_distill`)."""
    quiet_model_loading()
    torch.manual_seed(args.seed)
    target = load_model(args.target, device=args.device)
    if not 1 <= args.draft_vocab <= target.vocab_size:
        raise InvalidArgumentError(
            "draft_vocab", f"must be in [1, {target.vocab_size}] (the target's vocabulary), got {args.draft_vocab}"
        )
    if args.layers < 1:
        raise InvalidArgumentError("layers", f"must be >= 1, got {args.layers}")
    if args.responses_per_prompt < 1:
        raise InvalidArgumentError("responses_per_prompt", f"must be >= 1, got {args.responses_per_prompt}")
    if args.categories and args.data is not None:
        raise InvalidArgumentError("categories", "chooses from the built-in prompt set; --data gives its own")
    _categories(args.categories)  # a misspelt category is refused before any data is written
    out = (args.out or default_head_dir(args.target)).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = distill_data_dir(args.target) if args.data is None else out / "data"
    started = time.monotonic()
    fused = args.features == "fused"
    data_dtype = generation_dtype(args.data_dtype, target.model)
    train_dtype = training_dtype(args.train_dtype, target.model)
    print(
        f"training data in {dtype_name(data_dtype)} (--data-dtype {args.data_dtype}), "
        f"the head trains in {dtype_name(train_dtype)} (--train-dtype {args.train_dtype})",
        file=sys.stderr,
    )
    train_examples, held_out = collect_data(target, args, data_dir, fused=fused, dtype=data_dtype)
    data_minutes = (time.monotonic() - started) / 60
    vocab = _draft_vocab(out, train_examples, args.draft_vocab, target)
    feature_layers = eagle3_layers(int(target.model.config.num_hidden_layers)) if fused else ()
    head = EagleHead.from_target(target.model, vocab, num_layers=args.layers, feature_layers=feature_layers)
    config = TrainConfig(
        steps=args.steps,
        minutes=args.minutes if args.minutes is not None or args.steps is not None else 10.0,
        learning_rate=args.learning_rate,
        unroll_steps=args.unroll_steps,
        feature_weight=args.feature_weight,
        eval_every=args.eval_every,
        seed=args.seed,
        bf16=train_dtype == torch.bfloat16,
    )
    batches = make_batches(train_examples, config.batch_tokens, config.max_length, fused=fused)
    held_out_batches = make_batches(held_out, config.batch_tokens, config.max_length, fused=fused)
    held_out_batches = with_target_argmax(held_out_batches, target.model.get_output_embeddings().weight, vocab)
    examples, training_tokens = len(train_examples), sum(e.response_length for e in train_examples)
    del train_examples, held_out  # the batches hold what training reads
    info = HeadInfo(verifier=args.target, num_draft_tokens=4)
    best: list[float] = [-1.0]
    snapshots = sorted(float(m) for m in args.snapshot_minutes.split(",") if m.strip())
    seen = [0]
    bar = tqdm(total=config.steps, desc="distill", unit="step", file=sys.stderr)
    state_path = out / CHECKPOINT_FILE  # a resumed run counts the minutes already spent
    spent = torch.load(state_path, weights_only=False)["seconds"] if state_path.is_file() else 0.0
    train_started = time.monotonic() - spent

    def summary(result: EvalResult) -> dict:
        return {
            "out": str(out),
            "examples": examples,
            "training_tokens": training_tokens,
            "features": args.features,
            "tokens_seen": seen[0],
            "draft_vocab": len(vocab),
            "data_minutes": round(data_minutes, 2),
            "data_dtype": dtype_name(data_dtype),
            "train_dtype": dtype_name(train_dtype),
            "train_minutes": round((time.monotonic() - train_started) / 60, 2),
            "held_out_agreement": [round(a, 4) for a in result.agree],
        }

    def on_step(step: int, loss: float, tokens_seen: int) -> None:
        seen[0] = tokens_seen
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    def on_eval(step: int, result: EvalResult) -> None:
        score = sum(result.agree)
        bar.write(f"step {step}: held-out loss {result.loss:.3f}, agreement by depth {_fmt(result.agree)}")
        if score > best[0]:  # early stopping: keep the head that agrees best on prompts it never saw
            best[0] = score
            save_head(head, out, info)
            _write_summary(out, summary(result))
        minutes = (time.monotonic() - train_started) / 60
        while snapshots and minutes >= snapshots[0]:  # the same run at a smaller budget, for the scaling table
            copy = out / "snapshots" / f"{snapshots.pop(0):g}min"
            save_head(head, copy, info)
            _write_summary(copy, summary(result))

    result = train(head, batches, held_out_batches, config, checkpoint_dir=out, on_eval=on_eval, on_step=on_step)
    bar.close()
    if best[0] < 0:
        save_head(head, out, info)
        _write_summary(out, summary(result))
    print(json.dumps(_choose_lookup(out, held_out_batches)))
    return 0


def _choose_lookup(out: Path, held_out: list[Batch]) -> dict:
    """Measure which prompt-lookup tail pays with the saved head (:mod:`specdec.distill.lookup_choice`) and keep it
    in its config and summary; the summary."""
    head, info = load_head(out)
    choice = calibrate_lookup(head, held_out)
    save_head_config(head, out, dataclasses.replace(info, lookup_min_match=choice.min_match))
    summary = json.loads((out / SUMMARY_FILE).read_text())
    summary["lookup_min_match"] = choice.min_match
    summary["lookup_tokens_per_round"] = {str(size): round(value, 4) for size, value in choice.tokens_per_round.items()}
    _write_summary(out, summary)
    return summary


def _write_summary(directory: Path, summary: dict) -> None:
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def collect_data(
    target: LoadedModel, args: argparse.Namespace, data_dir: Path, *, fused: bool, dtype: torch.dtype
) -> tuple[list[Example], list[Example]]:
    """Training and held-out examples: what the cache holds, plus what the time budget adds (``fused``: with the
    fused layers' rows, which only a fused head reads). The target makes the held-out examples as it is loaded (they
    rank checkpoints, so they are what serving sees) and the training examples in ``dtype``
    (:func:`~specdec.distill.dtypes.generation_dtype`), a copy made only if there are any to make."""
    if target.tokenizer is None:
        raise InvalidArgumentError("target", f"{target.name!r} has no tokenizer to apply the chat template")
    runner = KVRunner(target.model)
    fused_layers = eagle3_layers(runner.num_layers)  # kept beside the final norm's rows: either head kind trains

    @functools.cache
    def train_runner() -> KVRunner:
        model = model_in_dtype(target.model, dtype)
        return runner if model is target.model else KVRunner(model)

    if args.data is not None:
        conversations = read_conversations(args.data)
        random.Random(args.seed).shuffle(conversations)
        cut = max(1, len(conversations) // 20)  # 5 % held out
        splits = {"heldout": conversations[:cut], "train": conversations[cut:]}

        def teacher_force(todo: list[Conversation], generator: KVRunner) -> Iterator[Example]:
            return teacher_force_examples(
                generator, target.tokenizer, todo, max_tokens=args.max_tokens, fused_layers=fused_layers
            )

        _fill(data_dir / "heldout", splits["heldout"], lambda t: teacher_force(t, runner))
        _fill(data_dir / "train", splits["train"], lambda t: teacher_force(t, train_runner()))
        return read_shards(data_dir / "train", fused=fused), read_shards(data_dir / "heldout", fused=fused)
    chosen = _categories(args.categories)
    held_rows = [r for r in load_prompt_set("heldout") if r.category in chosen]
    # categories in turn, so the checkpoints are ranked on every kind of prompt trained on (in file order, 64 rows
    # were chat, code and four maths)
    held_rows = [r for _, r in interleave_categories(held_rows, args.held_out_prompts, lambda r: r.category)]
    held = [Conversation(r.id, r.messages) for r in held_rows]
    train_rows = [r for r in load_prompt_set("train") if r.category in chosen]
    random.Random(args.seed).shuffle(train_rows)  # a time-bounded run still sees every category
    train_conversations = [
        Conversation(resample_id(r.id, sample), r.messages)
        for sample in range(args.responses_per_prompt)  # every prompt's first response before any second one
        for r in train_rows
    ]

    def generate(todo: list[Conversation], generator: KVRunner, minutes: float | None) -> Iterator[Example]:
        prompts = [(c.id, encode_chat(target.tokenizer, c.messages)) for c in todo]
        # the budget is the generation's own: the held-out data, the bfloat16 copy and the templating come first
        until = None if minutes is None else time.monotonic() + minutes * 60
        return generate_examples(
            generator,
            target.eos_token_ids,
            prompts,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            sampling_for=lambda index: sampling_for(index, todo[index].id),
            seed=args.seed,
            deadline=until,
            fused_layers=fused_layers,
        )

    _fill(data_dir / "heldout", held, lambda t: generate(t, runner, None))
    _fill(data_dir / "train", train_conversations, lambda t: generate(t, train_runner(), args.data_minutes))
    held_ids = {c.id for c in held}  # the cache may also hold another selection's held-out rows: rank on this one
    held_out = [e for e in read_shards(data_dir / "heldout", fused=fused) if e.id in held_ids]
    return read_shards(data_dir / "train", fused=fused), held_out


def _categories(text: str) -> set[str]:
    """The prompt-set categories ``--categories`` names (empty: all of them)."""
    named = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(named - set(CATEGORIES))
    if unknown:
        offered = ", ".join(sorted(CATEGORIES))
        raise InvalidArgumentError("categories", f"unknown {', '.join(unknown)}; the prompt set has {offered}")
    return named or set(CATEGORIES)


def _fill(
    directory: Path, conversations: list[Conversation], make: Callable[[list[Conversation]], Iterator[Example]]
) -> None:
    """Add to ``directory`` the examples of the conversations it does not hold yet."""
    done = {example.id for example in read_shards(directory, fused=False)} if directory.is_dir() else set()
    todo = [c for c in conversations if c.id not in done]
    if not todo:
        return
    writer = ShardWriter(directory, shard_size=64)
    bar = tqdm(total=len(todo), desc=f"data {directory.name}", unit="conv", file=sys.stderr)
    try:
        for example in make(todo):
            writer.add(example)
            bar.update(1)
    finally:
        writer.flush()
        bar.close()


RESAMPLE_MARK = "~"


def resample_id(prompt_id: str, sample: int) -> str:
    """The example id of the ``sample``-th response (from 0) to a prompt: the prompt's own id for the first."""
    return prompt_id if sample == 0 else f"{prompt_id}{RESAMPLE_MARK}{sample}"


def sampling_for(index: int, conversation_id: str) -> SamplingParams:
    """Settings of the ``index``-th conversation generated: a prompt's first response is greedy for three prompts
    in four and sampled at temperature 0.7 for the fourth, so the head sees both kinds of context; every further
    response is sampled (a second greedy one would repeat the first)."""
    sampled = RESAMPLE_MARK in conversation_id or index % 4 == 3
    return SamplingParams(temperature=0.7) if sampled else SamplingParams(temperature=0.0)


def _draft_vocab(out: Path, examples: list[Example], size: int, target: LoadedModel) -> torch.Tensor:
    """The draft vocabulary, chosen once per head directory (a resumed run must keep the same rows)."""
    path = out / VOCAB_FILE
    if path.is_file():
        vocab = torch.load(path, weights_only=True)
        if len(vocab) == size:
            return vocab
    vocab = choose_draft_vocab(examples, size, target.vocab_size, sorted(target.eos_token_ids))
    torch.save(vocab, path)
    return vocab


def _fmt(values: tuple[float, ...]) -> str:
    return " / ".join(f"{value:.3f}" for value in values)
