"""One request's outcome as the load generator saw it (client-side clock), successful or not.

Times are seconds. ``scheduled_s``, ``start_s`` and ``end_s`` are offsets from the start of the measured window
(warm-up requests: from the start of the warm-up); ``ttft_s`` and ``chunk_times_s`` from the request's own start.
``chunk_times_s`` holds the arrival of every streamed chunk that carried tokens: speculation commits several tokens
per round and the router streams them as one chunk, so, as ``vllm bench serve`` does, inter-token latency is the gap
between chunks, not divided by the tokens in them; a burst of 4 tokens then a 40 ms wait is an ITL of 40 ms, which
is what a reader of the stream waits. Failed requests are kept, with ``error`` set.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RequestError:
    """Why a request failed: ``kind`` is a gRPC status name in lower case (``deadline_exceeded`` for any
    timeout, ``resource_exhausted`` for 429/overload, ``unavailable``…) or ``internal`` for anything else."""

    kind: str
    message: str


TIMEOUT_KINDS = frozenset({"deadline_exceeded"})

# The per-request speculation counters of the router's final message, in seconds (the HTTP API sends ns).
SPECULATION_FIELDS: tuple[str, ...] = (
    "rounds",
    "draft_tokens",
    "accepted_tokens",
    "accepted_per_position",
    "draft_s",
    "verify_s",
    "state_s",
    "pipeline_hits",
    "pipeline_misses",
    "wire_bytes",
    "drafter_fallback",
)


def speculation_from_http(body: dict[str, Any]) -> dict[str, Any]:
    """The ``"speculation"`` object of the HTTP API in the SDK's units (``*_ns`` → ``*_s``)."""
    stats = {name: body[name] for name in SPECULATION_FIELDS if name in body}
    for part in ("draft", "verify", "state"):
        if f"{part}_ns" in body:
            stats[f"{part}_s"] = body[f"{part}_ns"] / 1e9
    return stats


@dataclass(frozen=True)
class RequestRecord:
    """One request; ``prompt_tokens`` and ``output_tokens`` are the router's usage counts (None if it failed)."""

    index: int
    prompt_id: str
    category: str
    start_s: float
    end_s: float
    scheduled_s: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: RequestError | None = None
    speculation: dict[str, Any] | None = None
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        times = self.chunk_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2el − ttft) / (output_tokens − 1); None below 2 tokens."""
        if self.ttft_s is None or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def rebased(self, origin: float, *, index: int, scheduled_s: float, warmup: bool) -> RequestRecord:
        """This record with ``start_s``/``end_s`` measured from ``origin`` and its place in the run."""
        return replace(
            self,
            index=index,
            scheduled_s=scheduled_s,
            start_s=self.start_s - origin,
            end_s=self.end_s - origin,
            warmup=warmup,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt_id": self.prompt_id,
            "category": self.category,
            "warmup": self.warmup,
            "scheduled_s": self.scheduled_s,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "e2el_s": self.e2el_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "itl_s": self.itl_s,
            "chunk_times_s": self.chunk_times_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "error": None if self.error is None else {"kind": self.error.kind, "message": self.error.message},
            "speculation": self.speculation,
        }
