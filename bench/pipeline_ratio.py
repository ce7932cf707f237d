"""Pipelined vs sequential speculation across draft / verify time ratios, on the real stack (issue 11).

Pipelining hides the shorter of drafting and verification behind the longer, so what it can buy depends on their
ratio: its bound over sequential speculation is ``(draft + verify) / max(draft, verify)`` per round, 2 when they are
equal. To move the ratio without changing what the head predicts, the trained eagle head is served at several
**draft-vocabulary sizes**: the same weights, its LM head widened with the target's own rows of more tokens (the
rows added in id order, as ``choose_draft_vocab`` fills; the full vocabulary at the largest). On this target the
LM head dominates the head's cost. With the head's draft layers over int8 weights (``--draft-quantization auto``, as
served on a CPU) the full vocabulary drafted a round in 0.16 of its verification (``pipeline-ratio-1.2m.md``); over
float32 weights (``--draft-quantization none``: the same head, its argmax the same but for rounding) a round's
drafting comes near its verification, the ratio where pipelining can pay most. ``--predraft-outcomes N`` lets each
pre-draft prepare N outcomes (multi-outcome pre-drafting: full acceptance and the likeliest rejections).

One verifier and, per size, one drafter and one router, all subprocesses on 127.0.0.1 with one torch thread each;
greedy chains of ``--gamma``, float32, EOS honoured, chat-templated prompts, one stream. Every repeat runs each
prompt in every configuration, interleaved prompt by prompt, and is reported on its own so the noise is visible.
Draft and verify ms per round are the sequential runs' (the workers' own timings); the pipelined run's draft time
also counts pre-drafts thrown away. Writes ``pipeline-ratio.json`` and ``.md``.

    python -m bench.pipeline_ratio --draft-vocab-sizes 8192,24576,49152 --output-dir bench/results
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.pipelining import Tally, fmt, load_average, machine_meta
from specdec.distill.prompts import interleave_categories


def widened_head(head_dir: Path, target: torch.nn.Module, size: int, out: Path) -> Path:
    """``head_dir``'s head with a draft vocabulary of ``size`` tokens (its own first, then by id), saved in ``out``."""
    from specdec.drafters.eagle_head import EagleHead, load_head, save_head

    head, info = load_head(head_dir)
    own = head.draft_to_target.tolist()
    chosen = set(own)
    extra = [token for token in range(head.vocab_size) if token not in chosen][: max(0, size - len(own))]
    ids = torch.tensor(sorted(own + extra))
    wide = EagleHead(head.layer_config, ids, head.vocab_size, head.feature_layers, head.options)
    weights = head.state_dict() | {
        "draft_to_target": wide.draft_to_target,
        "lm_head.weight": target.lm_head.weight[ids].detach().float(),
    }
    wide.load_state_dict(weights)
    save_head(wide, out, info)
    return out


def _ms(seconds: float, rounds: int) -> float | None:
    return round(1e3 * seconds / rounds, 2) if rounds else None


def summarise(sequential: Tally, pipelined: Tally, draft_s: float, verify_s: float) -> dict:
    """One size's row: the sequential run's per-round draft and verify ms, both runs' tokens/s, and the ratio
    beside its bound."""
    seq, pipe = sequential.summary(), pipelined.summary()
    draft, verify = _ms(draft_s, sequential.rounds), _ms(verify_s, sequential.rounds)
    ratio = pipe["tokens_per_s"] / seq["tokens_per_s"] if seq["tokens_per_s"] and pipe["tokens_per_s"] else None
    bound = (draft + verify) / max(draft, verify) if draft is not None and verify and max(draft, verify) else None
    return {
        "draft_ms_per_round": draft,
        "verify_ms_per_round": verify,
        "draft_over_verify": round(draft / verify, 3) if draft is not None and verify else None,
        "sequential_tokens_per_s": seq["tokens_per_s"],
        "pipelined_tokens_per_s": pipe["tokens_per_s"],
        "tokens_per_round": seq["tokens_per_round"],
        "hit_rate": pipe["hit_rate"],
        "pipelined_over_sequential": round(ratio, 3) if ratio is not None else None,
        "bound": round(bound, 3) if bound is not None else None,
        "of_bound": round(ratio / bound, 3) if ratio is not None and bound else None,
    }


def report(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Pipelined vs sequential across draft / verify ratios on `{meta['target']}`",
        "",
        f"{meta['date']} · {meta['cpu']} ({meta['cpus']} CPUs, load {meta['load_before']} before, "
        f"{meta['load_after']} after) · Python {meta['python']} · torch {meta['torch']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Head: `{meta['head']}` at draft-vocabulary sizes {meta['sizes']}. Greedy chains of γ = {meta['gamma']}, "
        f"float32, EOS honoured, max {meta['max_tokens']} new tokens, {meta['num_prompts']} chat prompts, 1 stream, "
        f"{meta['repeats']} interleaved repeats. Torch threads: verifier 1, each drafter 1. Draft layers: "
        f"`--draft-quantization {meta.get('draft_quantization', 'auto')}`; pre-drafts prepare "
        f"{meta.get('predraft_outcomes', 1)} outcome(s).",
        "",
        f"Greedy outputs identical to speculation off in every configuration and repeat: "
        f"**{'yes' if meta['all_identical'] else 'NO'}**. Speculation off: "
        + ", ".join(f"{value:.2f}" for value in meta["off_tokens_per_s"])
        + " tokens/s by repeat.",
        "",
        "| repeat | draft vocab | draft ms / round | verify ms / round | draft / verify | tokens / round | "
        "sequential tok/s | pipelined tok/s | hit rate | pipelined / sequential | bound | ÷ bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['repeat']} | {row['draft_vocab']} | {fmt(row['draft_ms_per_round'])} | "
            f"{fmt(row['verify_ms_per_round'])} | {fmt(row['draft_over_verify'])} | {fmt(row['tokens_per_round'])} | "
            f"{fmt(row['sequential_tokens_per_s'])} | {fmt(row['pipelined_tokens_per_s'])} | {fmt(row['hit_rate'])} | "
            f"{fmt(row['pipelined_over_sequential'])} | {fmt(row['bound'])} | {fmt(row['of_bound'])} |"
        )
    lines += [
        "",
        "bound = (draft + verify) / max(draft, verify): pipelined over sequential if every pre-draft hit and the "
        "router and wire cost nothing. Targets (issue 11): ≥ 1.5× where draft ≈ verify, ≥ 0.9 of the bound "
        "everywhere. tokens/s = output tokens / Σ end-to-end request time (client-measured).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft-model", type=Path, help="the trained head (default: the head cached for --target)")
    parser.add_argument("--draft-vocab-sizes", default="8192,24576,49152")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft-quantization", default="auto", help="the drafters' --draft-quantization")
    parser.add_argument("--predraft-outcomes", type=int, default=1, help="the drafters' --predraft-outcomes")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "specdec-bench-ratio")
    args = parser.parse_args(argv)

    from bench.colocated import PROMPTS, load_prompts
    from bench.services import Services
    from specdec.cache import default_head_dir
    from specdec.cli import encode_prompt
    from specdec.client import Client
    from specdec.models import load_model, quiet_model_loading

    quiet_model_loading()
    sizes = [int(size) for size in args.draft_vocab_sizes.split(",")]
    head_dir = (args.draft_model or default_head_dir(args.target)).expanduser()
    target = load_model(args.target)
    load_before = load_average()
    heads = Path(tempfile.mkdtemp(prefix="specdec-ratio-heads-"))
    paths = {size: widened_head(head_dir, target.model, size, heads / str(size)) for size in sizes}
    rows = interleave_categories(load_prompts(PROMPTS, None), args.num_prompts)
    prompts = [encode_prompt(target, row["prompt"], chat=True) for _, row in rows]
    with Services(args.log_dir) as services:
        verifier = services.spawn(
            "verifier", "verifier_service", ["--model", args.target, "--dtype", "float32", "--torch-threads", "1"]
        )
        options = ["--kind", "eagle", "--target", args.target, "--torch-threads", "1", "--draft-quantization",
                   args.draft_quantization, "--predraft-outcomes", str(args.predraft_outcomes)]  # fmt: skip
        drafters = {
            size: services.spawn(f"drafter-{size}", "drafter_service", [*options, "--draft-model", str(path)])
            for size, path in paths.items()
        }
        clients = {}
        for size, drafter in drafters.items():
            addresses = ["--verifier", verifier.wait_ready()["address"], "--drafter", drafter.wait_ready()["address"]]
            router = services.start(
                f"router-{size}", "router", ["--model", args.target, "--grpc-port", "0", "--http-port", "0", *addresses]
            )
            clients[size] = Client(router.ready["grpc"], timeout_s=600)
        base = {"max_tokens": args.max_tokens, "temperature": 0.0}
        spec = base | {"drafter": "eagle", "num_draft_tokens": args.gamma, "tree_width": 1}
        modes = ("sequential", "pipelined")
        try:
            for client in clients.values():  # warm-up, uncounted
                for mode in modes:
                    client.generate(prompt_ids=prompts[0][:16], **spec | {"speculation": mode, "max_tokens": 4})
            off = {repeat: Tally() for repeat in range(args.repeats)}
            tallies = {(r, s, m): Tally() for r in range(args.repeats) for s in sizes for m in modes}
            timings = {(r, s): [0.0, 0.0] for r in range(args.repeats) for s in sizes}  # sequential draft, verify s
            for repeat in range(args.repeats):
                for ids in prompts:
                    started = time.perf_counter()
                    result = clients[sizes[0]].generate(prompt_ids=ids, **base | {"speculation": "off"})
                    off[repeat].add(result.token_ids, time.perf_counter() - started, result.stats)
                    for size in sizes:
                        for mode in modes:
                            started = time.perf_counter()
                            result = clients[size].generate(prompt_ids=ids, **spec | {"speculation": mode})
                            tallies[repeat, size, mode].add(
                                result.token_ids, time.perf_counter() - started, result.stats
                            )
                            if mode == "sequential":
                                timings[repeat, size][0] += result.stats.draft_s
                                timings[repeat, size][1] += result.stats.verify_s
                print(f"repeat {repeat} done", flush=True)
        finally:
            for client in clients.values():
                client.close()

    table = []
    for repeat in range(args.repeats):
        for size in sizes:
            sequential, pipelined = tallies[repeat, size, "sequential"], tallies[repeat, size, "pipelined"]
            row = {"repeat": repeat, "draft_vocab": size}
            row |= summarise(sequential, pipelined, *timings[repeat, size])
            row["same_as_off"] = sequential.outputs == pipelined.outputs == off[repeat].outputs
            table.append(row)
    meta = {
        "target": args.target,
        "head": str(head_dir),
        "sizes": sizes,
        **machine_meta("bench.pipeline_ratio", argv, load_before),
        "gamma": args.gamma,
        "draft_quantization": args.draft_quantization,
        "predraft_outcomes": args.predraft_outcomes,
        "max_tokens": args.max_tokens,
        "num_prompts": len(prompts),
        "repeats": args.repeats,
        "off_tokens_per_s": [off[repeat].summary()["tokens_per_s"] for repeat in range(args.repeats)],
        "all_identical": all(row["same_as_off"] for row in table),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / "pipeline-ratio"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": table}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(report(meta, table))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
