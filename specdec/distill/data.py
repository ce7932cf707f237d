"""Self-distillation data: the target's own responses and its features, written to shards as they finish.

Each conversation becomes one :class:`Example`: the token ids of prompt + response, the prompt length, and the
target's feature rows (:meth:`~specdec.runner.KVRunner.forward_features`) of every position but the last (of a long
prompt, only those its training window reads: :func:`feature_window_start`): the final norm's output (what an
EAGLE-1 head reads and every head is trained to predict) and, when asked, the fused low / middle / high layer rows
an EAGLE-3 head reads instead. The features of a position are the target's
state after reading it; a drafter head trained on them learns to continue the target from its own state (EAGLE).

Two sources:

- :func:`generate_examples`: the target answers each prompt through the verification engine
  (:class:`~specdec.verification.BatchVerifier`) with target-only rounds, continuously batched (a finished
  sequence's slot is refilled at once). The forward that commits a token is a teacher-forced forward over
  prompt + response, so its feature rows are exactly those teacher forcing would give.
- :func:`teacher_force_examples`: a user's own conversations (prompt and response given), one forward each.

**Generation dtype.** Training data needs the target's answers and features, not its exact float32 arithmetic, so
the target may generate in bfloat16 (:func:`specdec.distill.dtypes.generation_dtype`): on a CPU with AMX it wrote 2.2x
the float32 tokens/s at 96 sequences at a time, and a head trained on those rows was as good on float32 held-out rows
(README).

Shards are ``torch.save`` files of at most ``shard_size`` examples, written as they complete, so a job killed
by its time budget keeps its finished shards and a rerun skips the records already done.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdec.drafters.base import Proposal
from specdec.drafters.eagle_head import HEAD_CONTEXT
from specdec.errors import InvalidArgumentError
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification import BatchVerifier, VerifyCall

# Shards store features in half precision: the final norm's rows (small) in float16, for its finer steps; the raw
# layer rows an EAGLE-3 head reads in bfloat16, the dtype the verifier sends them in, whose range holds their
# massive activations (22 500 on SmolLM2's layer 14). Older shards hold those rows RMS-normalised in float16; an
# fc_norm head reads both alike.
FEATURE_DTYPE, FUSED_DTYPE = torch.float16, torch.bfloat16
_EMPTY = Proposal(TokenTree.empty(), None)


@dataclass(frozen=True)
class Conversation:
    """What one example is made from: chat messages ending with a user turn (the target answers), or ending
    with an assistant turn (teacher forcing of the given response)."""

    id: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Example:
    """``token_ids`` [L] prompt + response; ``features`` [L - 1 - s, hidden] (final norm) and ``fused``
    [L - 1 - s, layers * hidden] (the fused layers, or None) at positions ``s .. L - 2``, ``s = features_start``.

    A long prompt keeps only the rows a head is trained on (:func:`feature_window_start`): the last ones."""

    id: str
    token_ids: torch.Tensor
    prompt_length: int
    features: torch.Tensor
    fused: torch.Tensor | None = None
    features_start: int = 0

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length


def feature_window_start(length: int, window: int = HEAD_CONTEXT) -> int:
    """The first position whose feature row an example of ``length`` tokens keeps: a head is trained on its last
    ``window`` head positions (``L - 1 - window .. L - 2``; :func:`specdec.distill.train.make_batches`), which read the
    rows from one position before. ``feature_window_start(100) == 0``; ``feature_window_start(2000) == 1358``."""
    return max(0, length - 2 - window)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the chat template, with the assistant's turn opened."""
    return list(
        tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def generate_examples(
    runner: KVRunner,
    eos_token_ids: frozenset[int],
    prompts: Iterable[tuple[str, list[int]]],
    *,
    max_tokens: int,
    batch_size: int,
    sampling_for: Callable[[int], SamplingParams],
    seed: int,
    max_prompt_tokens: int = 4096,
    prefill_tokens: int = 8192,
    deadline: float | None = None,
    fused_layers: Sequence[int] = (),
) -> Iterator[Example]:
    """The target's responses to ``prompts`` (``(id, token ids)``, e.g. :func:`encode_chat` of a conversation)
    with features, in completion order.

    ``sampling_for(index)`` gives the settings of the ``index``-th conversation (e.g. greedy for most, a
    temperature for some, so the head sees the contexts both kinds of request produce); its seed is
    ``seed + index``. At most ``batch_size`` sequences run together; no new one starts after ``deadline``
    (``time.monotonic()``). Prompts longer than ``max_prompt_tokens`` are skipped. A forward prefills the prompts
    of the sequences it starts, at most ``prefill_tokens`` of them together (one longer prompt alone): a batch of
    long prompts at once would hold attention scores of every one's length squared. ``fused_layers``: each example
    also keeps those layers' rows (``Example.fused``).
    """
    verifier = BatchVerifier(runner)
    layers = (*fused_layers, runner.num_layers)
    pending = ((index, item) for index, item in enumerate(prompts) if len(item[1]) <= max_prompt_tokens)
    waiting = next(pending, None)
    active: dict[str, tuple[list[int], list[torch.Tensor], list[int]]] = {}
    while True:
        prefilled = 0
        while waiting is not None and len(active) < batch_size and (deadline is None or time.monotonic() < deadline):
            index, (prompt_id, prompt) = waiting
            if prefilled and prefilled + len(prompt) > prefill_tokens:
                break
            prefilled += len(prompt)
            waiting = next(pending, None)
            verifier.open(
                prompt_id,
                prompt,
                sampling_for(index),
                seed + index,
                max_tokens,
                eos_token_ids,
                features=True,
                feature_layers=layers,
            )
            active[prompt_id] = (prompt, [], [])
        if not active:
            return
        outcomes = verifier.verify([VerifyCall(sequence_id, _EMPTY) for sequence_id in active])
        for sequence_id, outcome in zip(list(active), outcomes, strict=True):
            prompt, features, response = active[sequence_id]
            features.append(outcome.features)
            response.extend(outcome.verdict.emitted)
            if outcome.finish_reason is not None:
                verifier.close(sequence_id)
                del active[sequence_id]
                yield _example(sequence_id, prompt + response, len(prompt), torch.cat(features), runner.hidden_size)


def teacher_force_examples(
    runner: KVRunner,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Iterable[Conversation],
    *,
    max_tokens: int,
    fused_layers: Sequence[int] = (),
) -> Iterator[Example]:
    """Examples from conversations whose last message is the assistant's response (``--data FILE.jsonl``).

    The prompt is every message before the last through the chat template; the response is the rest of the
    templated conversation (at most ``max_tokens`` tokens). One forward per conversation gives its features.
    """
    verifier = BatchVerifier(runner)
    for conversation in conversations:
        messages = list(conversation.messages)
        if len(messages) < 2 or messages[-1].get("role") != "assistant":
            raise InvalidArgumentError("data", f"conversation {conversation.id!r} must end with an assistant message")
        prompt = encode_chat(tokenizer, messages[:-1])
        full = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        if full[: len(prompt)] != prompt or len(full) <= len(prompt):
            raise InvalidArgumentError("data", f"conversation {conversation.id!r}: the template does not extend")
        tokens = full[: len(prompt) + max_tokens]
        verifier.open(
            conversation.id,
            tokens,
            SamplingParams(temperature=0.0),
            0,
            1,
            frozenset(),
            features=True,
            feature_layers=(*fused_layers, runner.num_layers),
        )
        try:
            (outcome,) = verifier.verify([VerifyCall(conversation.id, _EMPTY)])
        finally:
            verifier.close(conversation.id)
        yield _example(conversation.id, tokens, len(prompt), outcome.features, runner.hidden_size)


def _example(id_: str, tokens: list[int], prompt_length: int, rows: torch.Tensor, hidden_size: int) -> Example:
    """An example from feature rows [L - 1, (layers + 1) * hidden]: the fused layers' blocks, then the final norm's;
    only the rows of its training window (:func:`feature_window_start`) are kept."""
    start = feature_window_start(len(tokens))
    rows = rows[start:]
    fused = rows[:, :-hidden_size].to(FUSED_DTYPE) if rows.shape[1] > hidden_size else None
    final = rows[:, -hidden_size:].to(FEATURE_DTYPE)
    return Example(id_, torch.tensor(tokens, dtype=torch.int32), prompt_length, final, fused, start)


def read_conversations(path: Path) -> list[Conversation]:
    """``{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}`` per line (``id`` optional)."""
    conversations = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                messages = tuple({"role": m["role"], "content": m["content"]} for m in row["messages"])
            except (ValueError, KeyError, TypeError) as error:
                raise InvalidArgumentError("data", f"{path}:{number}: not a conversation ({error})") from error
            conversations.append(Conversation(str(row.get("id", f"line-{number}")), messages))
    return conversations


class ShardWriter:
    """Writes examples to ``directory/shard-NNNNN.pt`` every ``shard_size`` examples (and at :meth:`close`)."""

    def __init__(self, directory: Path, shard_size: int = 256) -> None:
        self.directory = directory
        self.shard_size = shard_size
        directory.mkdir(parents=True, exist_ok=True)
        self._buffer: list[Example] = []
        self._next = len(list(directory.glob("shard-*.pt")))

    def add(self, example: Example) -> None:
        self._buffer.append(example)
        if len(self._buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        shard = {
            "ids": [e.id for e in self._buffer],
            "token_ids": [e.token_ids for e in self._buffer],
            "prompt_lengths": [e.prompt_length for e in self._buffer],
            "features": [e.features for e in self._buffer],
            "fused": [e.fused for e in self._buffer],
            "features_starts": [e.features_start for e in self._buffer],
        }
        final = self.directory / f"shard-{self._next:05d}.pt"
        partial = final.with_suffix(".partial")
        torch.save(shard, partial)
        partial.rename(final)  # a killed job never leaves a half-written shard under the final name
        self._next += 1
        self._buffer = []


def read_shards(directory: Path, *, fused: bool = True) -> list[Example]:
    """Every example stored under ``directory`` (in shard order); ``fused=False`` leaves out the fused rows.

    Shards are memory-mapped: rows are read from disk when used, so listing a large data set (or the ids of what
    it holds) costs no memory.
    """
    examples = []
    for path in sorted(directory.glob("shard-*.pt")):
        shard = torch.load(path, weights_only=True, mmap=True)
        count = len(shard["ids"])
        rows = shard.get("fused") if fused else None  # shards written before fused rows existed have none
        starts = shard.get("features_starts") or [0] * count  # older shards hold every position's rows
        examples += [
            Example(*fields)
            for fields in zip(
                shard["ids"],
                shard["token_ids"],
                shard["prompt_lengths"],
                shard["features"],
                rows or [None] * count,
                starts,
                strict=True,
            )
        ]
    return examples
