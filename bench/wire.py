"""What one round costs in serialisation, copies and detokenisation, step by step (a CPU micro-bench, no sockets).

A round of one stream, as the router and the workers run it: the drafter encodes its proposal
(:func:`~grpc_common.convert_rows.proposal_to_wire`), the router parses the drafter's ``Batch`` reply, decodes the tree
(:func:`~grpc_common.convert.tree_from_wire`), wraps the proposal into a ``VerifyRequest`` inside a ``VerifierCall``
(protobuf copies a sub-message on construction), serialises the verifier's ``Batch``, which the verifier parses and
decodes into dense ``q`` rows (:func:`~grpc_common.convert_rows.proposal_from_wire`); the verdicts come back in one
``Batch`` reply, the router sizes messages for its wire-bytes counters (``ByteSize``) and detokenises the emitted
tokens (:class:`router.text.TextStream`). Each step is timed on its own with the process's CPU clock
(``time.process_time``: best of ``--repeats`` runs of ``--number`` calls, so other work on the machine matters
little), for a chain of ``--gamma`` draft tokens with ``--support`` ids per ``q`` row and Batches of ``--batch``
calls. ``msgpack`` (where installed) is timed on the same proposal (ids and probs as raw bytes, the tree as int
lists) against protobuf: it carried nothing better (more bytes, slower to encode), so it is no dependency.

Writes ``NAME.json`` and ``NAME.md`` into ``--result-dir``.

    python -m bench.wire --result-dir bench/results
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from specdec_wire.v1 import common_pb2, drafter_pb2, verifier_pb2

from bench.load.report import elide_option, write_report
from grpc_common.convert import tree_from_wire
from grpc_common.convert_rows import proposal_from_wire, proposal_to_wire
from router.text import TextStream
from specdec.drafters.base import Proposal
from specdec.model_files import load_tokenizer
from specdec.tree import TokenTree

VOCAB = 49152  # SmolLM2's
ROUND_TOKENS = 3  # tokens a round commits: 2.6-2.7 on the simulated stack, 1.8-2 with the trained EAGLE head


def cpu_us(function: Callable[[], object], number: int, repeats: int) -> float:
    """Best of ``repeats`` runs: CPU microseconds per call of ``function``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(number):
            function()
        best = min(best, time.process_time() - start)
    return 1e6 * best / number


def draft_proposal(gamma: int, support: int, seed: int) -> Proposal:
    """A chain of ``gamma`` tokens, each node's ``q`` a row of ``support`` ids (its own token included)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(32, VOCAB, (gamma,), generator=generator).tolist()
    rows = torch.zeros(gamma, VOCAB)
    for node, token in enumerate(tokens):
        others = torch.randint(32, VOCAB, (support - 1,), generator=generator)
        weights = torch.rand(support, generator=generator)
        rows[node, others] = weights[1:]
        rows[node, token] = weights[0]
        rows[node] /= rows[node].sum()
    return Proposal(TokenTree.chain(tokens), rows, "iid")


def msgpack_steps(message: common_pb2.Proposal, number: int, repeats: int) -> dict[str, Any] | None:
    """The same proposal as msgpack (tree as int lists, rows as raw bytes) vs protobuf: size, encode, decode; None
    where msgpack is not installed (it is no dependency: this comparison is why)."""
    try:
        import msgpack
    except ImportError:
        return None

    def as_plain() -> dict[str, Any]:
        draft = message.draft
        return {
            "tokens": list(message.tree.tokens),
            "parents": list(message.tree.parents),
            "rows": [[row.ids, row.probs] for row in draft.rows],
            "node_rows": list(draft.node_rows),
        }

    plain = as_plain()
    packed = msgpack.packb(plain)
    wire = message.SerializeToString()
    return {
        "protobuf_bytes": len(wire),
        "msgpack_bytes": len(packed),
        "protobuf_encode_us": cpu_us(message.SerializeToString, number, repeats),
        "msgpack_encode_us": cpu_us(lambda: msgpack.packb(as_plain()), number, repeats),
        "protobuf_decode_us": cpu_us(lambda: common_pb2.Proposal.FromString(wire), number, repeats),
        "msgpack_decode_us": cpu_us(lambda: msgpack.unpackb(packed), number, repeats),
    }


def measure(gamma: int, support: int, batch: int, number: int, repeats: int) -> dict[str, Any]:
    proposals = [draft_proposal(gamma, support, seed) for seed in range(batch)]
    wires = [proposal_to_wire(proposal) for proposal in proposals]
    drafter_reply = drafter_pb2.DrafterBatchReply(
        results=[
            drafter_pb2.DrafterResult(propose=drafter_pb2.ProposeReply(proposal=wire, draft_ns=1_000_000))
            for wire in wires
        ]
    ).SerializeToString()
    parsed_drafter = drafter_pb2.DrafterBatchReply.FromString(drafter_reply)
    payloads = [result.propose.proposal for result in parsed_drafter.results]

    def verifier_request() -> verifier_pb2.VerifierBatchRequest:
        return verifier_pb2.VerifierBatchRequest(
            calls=[
                verifier_pb2.VerifierCall(
                    verify=verifier_pb2.VerifyRequest(sequence_id=f"seq-{index}", proposal=payload, defer_bonus=True)
                )
                for index, payload in enumerate(payloads)
            ]
        )

    request_bytes = verifier_request().SerializeToString()
    verdict = common_pb2.Verdict(accepted_path=[0, 1], emitted=[11, 12, 13])
    reply = verifier_pb2.VerifyReply(verdict=verdict, verify_ns=15_000_000, batch_size=batch, forward_positions=300)
    verifier_reply = verifier_pb2.VerifierBatchReply(
        results=[verifier_pb2.VerifierResult(verify=reply) for _ in range(batch)]
    ).SerializeToString()
    parsed_reply = verifier_pb2.VerifierBatchReply.FromString(verifier_reply).results[0].verify

    def per_call(function: Callable[[], object], calls: int = 1) -> float:
        return cpu_us(function, number, repeats) / calls

    steps = {
        "drafter: proposal_to_wire": per_call(lambda: proposal_to_wire(proposals[0])),
        "router: parse the drafter's Batch reply": per_call(
            lambda: drafter_pb2.DrafterBatchReply.FromString(drafter_reply), batch
        ),
        "router: tree_from_wire": per_call(lambda: tree_from_wire(payloads[0].tree)),
        "router: VerifyRequest(proposal=...) in a VerifierCall (copies)": per_call(verifier_request, batch),
        "router: serialise the verifier's Batch": per_call(
            lambda: verifier_pb2.VerifierBatchRequest.SerializeToString(verifier_request()), batch
        )
        - per_call(verifier_request, batch),
        "verifier: parse the Batch": per_call(
            lambda: verifier_pb2.VerifierBatchRequest.FromString(request_bytes), batch
        ),
        "verifier: proposal_from_wire (dense q rows)": per_call(lambda: proposal_from_wire(payloads[0], VOCAB)),
        "router: parse the verifier's Batch reply": per_call(
            lambda: verifier_pb2.VerifierBatchReply.FromString(verifier_reply), batch
        ),
        "router: ByteSize of proposal + reply (wire counters)": per_call(
            lambda: (payloads[0].ByteSize(), parsed_reply.ByteSize())
        ),
    }
    return {
        "gamma": gamma,
        "support": support,
        "batch": batch,
        "proposal_bytes": len(wires[0].SerializeToString()),
        "steps_us_per_call": steps,
        "msgpack": msgpack_steps(wires[0], number, repeats),
    }


def detokenise(tokenizer_name: str, tokens: int, number: int, repeats: int) -> dict[str, Any]:
    """CPU per generated token of the router's TextStream, fed rounds of ``ROUND_TOKENS`` tokens without stop strings
    (one decode a round) and with one (a decode a token), and of one decode call through transformers vs the Rust
    tokenizer (the window TextStream decodes is a handful of tokens)."""
    tokenizer = load_tokenizer(tokenizer_name)
    text = "The quick brown fox jumps over the lazy dog; naïve café, 東京, and emoji 🙂 too. " * 8
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    prompt = tokenizer.encode("Rewrite this sentence, please.", add_special_tokens=False)
    window = ids[:8]

    def stream(stops: list[str]) -> Callable[[], None]:
        def run() -> None:
            out = TextStream(tokenizer, prompt, stops)
            for start in range(0, len(ids), ROUND_TOKENS):
                out.push(ids[start : start + ROUND_TOKENS])
            out.flush()

        return run

    return {
        "tokenizer": tokenizer_name,
        "tokens": len(ids),
        "round_tokens": ROUND_TOKENS,
        "text_stream_us_per_token": cpu_us(stream([]), max(1, number // 20), repeats) / len(ids),
        "text_stream_with_stop_us_per_token": cpu_us(stream(["</s>"]), max(1, number // 20), repeats) / len(ids),
        "transformers_decode_us": cpu_us(lambda: tokenizer.decode(window, skip_special_tokens=True), number, repeats),
        "rust_decode_us": cpu_us(
            lambda: tokenizer.backend_tokenizer.decode(window, skip_special_tokens=True), number, repeats
        ),
    }


def markdown(document: dict[str, Any]) -> str:
    wire, detok = document["wire"], document["detokenise"]
    lines = [
        f"# bench.wire {document['name']}",
        "",
        f"{document['date']} · {document['cpu_count']} CPUs (load {document['load_average']:.2f}) · "
        f"process CPU time, best of {document['repeats']} × {document['number']} calls. "
        f"Command: `{' '.join(document['command'])}`",
        "",
        f"Chain of γ = {wire['gamma']} tokens, q rows of {wire['support']} ids, Batches of {wire['batch']} calls; "
        f"one proposal is {wire['proposal_bytes']} bytes on the wire.",
        "",
        "| step (per call) | µs CPU |",
        "|---|---|",
    ]
    lines += [f"| {step} | {value:.2f} |" for step, value in wire["steps_us_per_call"].items()]
    mp = wire["msgpack"]
    if mp is not None:
        lines += [
            "",
            "| one proposal | protobuf | msgpack |",
            "|---|---|---|",
            f"| bytes | {mp['protobuf_bytes']} | {mp['msgpack_bytes']} |",
            f"| encode µs | {mp['protobuf_encode_us']:.2f} | {mp['msgpack_encode_us']:.2f} |",
            f"| decode µs | {mp['protobuf_decode_us']:.2f} | {mp['msgpack_decode_us']:.2f} |",
        ]
    lines += [
        "",
        f"Detokenisation ({detok['tokenizer']}, {detok['tokens']} tokens of mixed ASCII / accents / CJK / emoji): "
        f"TextStream {detok['text_stream_us_per_token']:.2f} µs per token in rounds of {detok['round_tokens']} "
        f"({detok['text_stream_with_stop_us_per_token']:.2f} with a stop string: a decode a token); "
        "one decode of 8 tokens "
        f"{detok['transformers_decode_us']:.2f} µs through transformers, {detok['rust_decode_us']:.2f} µs through "
        "the Rust tokenizer.",
    ]
    if document["note"]:
        lines += ["", document["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wire", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--support", type=int, default=4, help="ids per q row (the drafter's top-k)")
    parser.add_argument("--batch", type=int, default=64, help="calls per Batch RPC")
    parser.add_argument("--number", type=int, default=2000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--note", default="", help="a paragraph for the report (what it was compared with)")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="wire")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    document = {
        "name": args.name,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": ["python", "-m", "bench.wire", *elide_option(argv if argv is not None else sys.argv[1:], "--note")],
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "number": args.number,
        "repeats": args.repeats,
        "note": args.note,
        "wire": measure(args.gamma, args.support, args.batch, args.number, args.repeats),
        "detokenise": detokenise(args.tokenizer, args.tokens, args.number, args.repeats),
    }
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
