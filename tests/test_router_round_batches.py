"""Many streams' rounds cost one ``Batch`` per worker per round, not one RPC per call (issue 15, router batching).

The workers are the in-memory fakes of test_router_pipeline behind a :class:`~router.batching.CallBatcher` whose
send function plays the worker's ``Batch`` RPC: it counts every batch and the calls it carries, then answers them
all together, as a real worker's reply does. Every answer of a batch resolves in one loop tick, every session
makes its next call before the batcher flushes, so the streams stay in lockstep: a worker sees one batch per round
of the longest stream, each carrying the call of every stream still running. A round that drafts nothing (the last,
with one token left) does not wait for the drafter, so its verification travels one tick ahead of the drafted
rounds of the same index: one more verify Batch for that round, still one per tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from router.batching import CallBatcher
from router.pipeline import Chunk, Commit, Drafted, Final, RoundRecord, SequenceSpec, Session, Verified
from tests.test_router_pipeline import FakeDrafter, FakePlacement, FakeVerifier, assert_clean, make_plan, reference

Call = Callable[[], Awaitable[Any]]
PROMPTS = [(3, 1, 4, 1, 5), (2, 7, 1, 8), (1, 4, 1, 4, 2, 1), (9, 9), (5, 3, 5), (8,), (6, 2, 8, 3), (1, 1)]


class BatchedWorker:
    """A fake worker whose calls go through a CallBatcher; ``batches`` lists, per Batch, the names of its calls."""

    def __init__(self, worker: FakeVerifier | FakeDrafter) -> None:
        self.worker = worker
        self.address = worker.address
        self.batcher: CallBatcher[tuple[str, Call], Any] = CallBatcher(worker.address, self._send)
        self.batches: list[list[str]] = []

    async def _send(self, calls: list[tuple[str, Call]]) -> Sequence[Any]:
        self.batches.append([name for name, _ in calls])
        results = []
        for _, call in calls:  # each call's failure is its own, as in a real Batch
            try:
                results.append(await call())
            except Exception as error:
                results.append(error)
        return results

    async def _submit(self, name: str, call: Call) -> Any:
        result = await self.batcher.submit((name, call))
        if isinstance(result, Exception):
            raise result
        return result

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        await self._submit("open", lambda: self.worker.open(sequence_id, spec, seed))

    async def close(self, sequence_id: str) -> None:
        await self._submit("close", lambda: self.worker.close(sequence_id))

    @property
    def sequences(self) -> dict[str, dict]:
        return self.worker.sequences

    def calls(self, name: str) -> list[int]:
        """Calls named ``name`` per batch that has any."""
        return [count for batch in self.batches if (count := batch.count(name))]


class BatchedVerifier(BatchedWorker):
    worker: FakeVerifier

    async def verify(
        self, sequence_id: str, drafted: Drafted | None, *, defer_bonus: bool, stop_features: bool = False
    ) -> Verified:
        return await self._submit("verify", lambda: self.worker.verify(sequence_id, drafted, defer_bonus=defer_bonus))


class BatchedDrafter(BatchedWorker):
    worker: FakeDrafter
    feature_width = 0
    feature_layers = ()
    feature_context = 0
    lookup_min_match = 0
    kind = None

    async def propose(
        self,
        sequence_id: str,
        max_tokens: int,
        *,
        assume_previous_accepted: bool,
        commit: Commit | None = None,
        propose_id: int = 0,
    ) -> Drafted:
        def call() -> Awaitable[Drafted]:  # the Commit rides in the Propose's own message, as on the wire
            return self.worker.propose(
                sequence_id, max_tokens, assume_previous_accepted=assume_previous_accepted, commit=commit
            )

        return await self._submit("propose", call)

    async def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: Sequence[int],
        features: object | None = None,
        cancel_through: int = 0,
    ) -> None:
        await self._submit("commit", lambda: self.worker.commit(sequence_id, base_length, emitted))


class RoundSizes:
    """A round observer that lists each round's proposal size."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def on_proposal(self, drafted: Drafted) -> None:
        pass

    def on_round(self, record: RoundRecord) -> None:
        self.sizes.append(record.draft_size)


@pytest.mark.parametrize("mode", ["sequential", "off"])
def test_many_streams_send_one_batch_per_worker_per_round(mode: str) -> None:
    verifier = BatchedVerifier(FakeVerifier())
    drafter = BatchedDrafter(FakeDrafter(wrong_every=3))
    placement = FakePlacement([verifier], [drafter])  # type: ignore[list-item]
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    sizes: list[list[int]] = [[] for _ in PROMPTS]  # per stream, the proposal size of each round

    def session(index: int) -> Session:
        async def emit(chunk: Chunk) -> None:
            outputs[index].extend(chunk.token_ids)

        plan = replace(make_plan(mode, max_tokens=24), prompt_ids=PROMPTS[index])
        observer = RoundSizes(sizes[index])
        return Session(plan, placement, emit, sequence_id=f"s{index}", observer=observer)  # type: ignore[arg-type]

    async def main() -> list[Final]:
        return list(await asyncio.gather(*(session(index).run() for index in range(len(PROMPTS)))))

    finals = asyncio.run(main())
    for prompt, output, final in zip(PROMPTS, outputs, finals, strict=True):
        assert output == reference(prompt, 24)[0] and final.finish_reason == "length"
    rounds = [final.stats.rounds for final in finals]
    verifies = verifier.calls("verify")
    # one Batch per round index and kind (drafted or not), each carrying the verify of every such stream
    kinds = {(index, size > 0) for stream in sizes for index, size in enumerate(stream)}
    assert len(verifies) == len(kinds) and sum(verifies) == sum(rounds)
    assert len(verifies) < max(rounds) + 2 if mode == "sequential" else len(verifies) == max(rounds)
    assert verifies[0] == len(PROMPTS)
    assert verifier.calls("open") == [len(PROMPTS)] and sum(verifier.calls("close")) == len(PROMPTS)
    if mode == "sequential":
        proposals = drafter.calls("propose")
        assert len(proposals) == max(rounds) and proposals[0] == len(PROMPTS)
        assert sum(proposals) == sum(rounds) - sum(final.stats.rounds_per_draft_size[0] for final in finals)
    else:
        assert drafter.batches == []
    assert_clean(placement)
