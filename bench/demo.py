"""``make demo``: the real serving path on smollm2-135m, with and without speculation.

First the EAGLE head: the one cached for the target (``specdec distill --target smollm2-135m``, the full budget
the benchmarks use) or, on a fresh machine, one trained now on a small budget (a few minutes; weaker). Then
``specdec up`` places a verifier, an eagle and an ngram drafter and the router on a local Ray instance; three real
prompts go through the SDK with speculation off and with each drafter, and one more over the OpenAI-compatible HTTP
API. Greedy, so every configuration must produce the same tokens; the table shows what speculation bought.
``specdec down`` always runs at the end. Three minutes with a cached head, up to ten without, on two CPU cores.
(The early-exit drafter, which has no trained exit and costs 3x here, is left out to keep a first demo within ten
minutes; ``python -m bench.colocated`` measures it.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.colocated import PROMPTS, load_prompts
from specdec.cache import default_head_dir
from specdec.client import Client, GenerateResult
from specdec.distill.prompts import CATEGORIES as PROMPT_SET_CATEGORIES
from specdec.distill.prompts import LONG_CONTEXT
from specdec.drafters.eagle_head import CONFIG_FILE, load_head
from specdec.errors import SpecdecError

TARGET = "smollm2-135m"
MAX_TOKENS = 64
CATEGORIES = ("code", "rewrite", "chat")
FULL_HEAD_COMMAND = f"specdec distill --target {TARGET} --responses-per-prompt 3 --data-minutes 100 --minutes 130"
# A few minutes of training favour a faster learning rate and no training-time unrolling: on the same 2.5 minutes of
# data, 2.5 minutes at 3e-3 without unrolling (~410 steps) reached a held-out tau of 1.44 at gamma = 4 against 1.21 at
# the defaults (1e-3, 3 unrolled steps: ~150 steps); bench/results/eagle-demo-head.md.
# The demo's prompts are short: its few minutes of data leave the long-context prompts (a prefill of 650-2 000
# tokens each) to the full head.
SHORT_CATEGORIES = ",".join(category for category in PROMPT_SET_CATEGORIES if category != LONG_CONTEXT)
DEMO_HEAD_ARGS = ["--target", TARGET, "--data-minutes", "2.5", "--minutes", "2.5", "--held-out-prompts", "16",
                  "--learning-rate", "3e-3", "--unroll-steps", "1", "--categories", SHORT_CATEGORIES]  # fmt: skip
UP_ARGS = [
    "--target", TARGET,
    "--drafter-kind", "eagle",
    "--drafter-kind", "ngram",
    "--num-cpus", "2",
    "--verifier-arg=--torch-threads=1",
    "--drafter-arg=--torch-threads=1",  # the eagle head's draft layers run over int8 weights (the default, auto)
]  # fmt: skip
CONFIGS = {  # name -> SDK options; the eagle rows name no shape but the chain's: the server's default, a greedy
    # dynamic tree (the 4 likeliest of the nodes drafted 4 levels deep, 3 children under each of the 3 likeliest
    # nodes a level), co-located here 1.77x target-only against 1.70x for the chain of 4 (eagle-default-shape.md)
    "speculation off": {"speculation": "off"},
    "eagle, auto": {"speculation": "auto", "drafter": "eagle"},
    "eagle chain, auto": {"speculation": "auto", "drafter": "eagle", "tree_width": 1},
    "eagle, sequential": {"speculation": "sequential", "drafter": "eagle"},
    "eagle, pipelined": {"speculation": "pipelined", "drafter": "eagle"},
    "ngram, pipelined": {"speculation": "pipelined", "drafter": "ngram"},
}


@dataclass
class Totals:
    """One configuration over the prompts."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, result: GenerateResult) -> None:
        self.tokens += len(result.token_ids)
        self.seconds += result.elapsed_s
        self.rounds += result.stats.rounds
        self.accepted += result.stats.accepted_tokens
        self.outputs.append(result.token_ids)


def specdec(*args: str, timeout_s: float = 900) -> str:
    """Run ``specdec ARGS`` (this interpreter); its stdout, or RuntimeError with its stderr."""
    run = subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=timeout_s
    )
    if run.returncode != 0:
        raise RuntimeError(f"specdec {args[0]} exited with status {run.returncode}:\n{run.stderr[-3000:]}")
    return run.stdout


def chat_over_http(address: str, prompt: str) -> dict:
    body = {
        "model": TARGET,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "speculation": "pipelined",
        "drafter": "ngram",
    }
    request = urllib.request.Request(
        f"http://{address}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def run_demo(router: dict, prompts: list[dict]) -> None:
    totals = {name: Totals() for name in CONFIGS}
    ngram_texts: list[str] = []
    with Client(router["grpc"], timeout_s=300) as client:
        for options in CONFIGS.values():  # warm-up (connections, first calls), not counted
            client.generate("Hi", chat=True, max_tokens=4, temperature=0, **options)
        for row in prompts:
            results = {
                name: client.generate(row["prompt"], chat=True, max_tokens=MAX_TOKENS, temperature=0, **options)
                for name, options in CONFIGS.items()
            }
            for name, result in results.items():
                totals[name].add(result)
            answer = results["speculation off"].text.strip().replace("\n", " ")
            print(f"[{row['category']}] {row['prompt'].splitlines()[0][:70]}")
            print(f"  → {answer[:150]}{'…' if len(answer) > 150 else ''}\n", flush=True)
            ngram_texts.append(results["ngram, pipelined"].text)

    print(f"HTTP POST http://{router['http']}/v1/chat/completions  (ngram, pipelined, first prompt)")
    reply = chat_over_http(router["http"], prompts[0]["prompt"])
    http_text = reply["choices"][0]["message"]["content"]
    speculation = reply.get("speculation", {})
    print(
        f"  finish_reason={reply['choices'][0]['finish_reason']}  usage={reply['usage']}  "
        f"mean accepted length {speculation.get('mean_accepted_length', 0):.2f}"
    )
    print(f"  same text as through the SDK: {'yes' if http_text == ngram_texts[0] else 'NO'}\n")

    baseline = totals["speculation off"]
    header = ("configuration", "tokens", "tokens/s", "speed-up", "accepted len", "same tokens")
    print("{:<22} {:>6} {:>9} {:>9} {:>13} {:>12}".format(*header))
    for name, total in totals.items():
        same = sum(a == b for a, b in zip(total.outputs, baseline.outputs, strict=True))
        rate = total.tokens / total.seconds
        accepted = 1 + total.accepted / total.rounds if total.rounds else 1.0
        print(
            f"{name:<22} {total.tokens:>6} {rate:>9.1f} {rate * baseline.seconds / baseline.tokens:>8.2f}x "
            f"{accepted:>13.2f} {same:>8}/{len(prompts)}"
        )
    print(
        f"\nGreedy, float32, max {MAX_TOKENS} new tokens, one request at a time through the router; tokens/s is "
        "over the client's end-to-end time (prefill included); every drafter must give the same tokens as no "
        "speculation.\n`auto`, the server's default, picks each round's draft length (0 included) from "
        "the request's measured acceptance and the verifier's measured costs; the eagle rows verify up to the 4 "
        "likeliest nodes of a tree drafted 4 levels deep (the server's default shape), the chain row a chain of 4.\n"
        "The eagle drafter is a one-layer head trained on the target's own outputs "
        f"and features (the target's features travel to it with every verdict); the full head: `{FULL_HEAD_COMMAND}`."
    )


def ensure_head(head: Path | None = None) -> None:
    """Reuse the cached head for the target, or train a small one now (the full one, ``FULL_HEAD_COMMAND``, takes
    about four hours: 80 minutes of data, 140 of training). A cached head that cannot be served (one of an older
    layout) stops the demo with the reason, before anything starts."""
    head = head or default_head_dir(TARGET)
    if (head / CONFIG_FILE).is_file():
        try:
            load_head(head)
        except SpecdecError as error:
            raise SystemExit(
                f"EAGLE head: the cached one cannot be served ({error}). Move {head} aside and rerun to train a "
                f"small one, or make the full one: `{FULL_HEAD_COMMAND}`"
            ) from None
        print(f"EAGLE head: cached in {head}\n", flush=True)
        return
    print(f"EAGLE head: none cached in {head}; training a small one now (about 6 minutes; the full one: "
          f"`{FULL_HEAD_COMMAND}`) …", flush=True)  # fmt: skip
    started = time.perf_counter()
    summary = json.loads(specdec("distill", *DEMO_HEAD_ARGS, timeout_s=1200).strip().splitlines()[-1])
    lookup = summary["lookup_min_match"]
    print(f"  {summary['examples']} conversations, {summary['training_tokens']} response tokens, held-out agreement "
          f"{summary['held_out_agreement'][0]:.3f}, prompt lookup {f'from a {lookup}-token tail' if lookup else 'off'} "
          f"(measured), {time.perf_counter() - started:.0f} s\n", flush=True)  # fmt: skip


def first_router(up: dict) -> dict:
    """The addresses of the first router ``specdec up`` reports (the demo starts one)."""
    return up["routers"][0]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rows = load_prompts(PROMPTS, set(CATEGORIES))
    prompts = [next(row for row in rows if row["category"] == category) for category in CATEGORIES]
    ensure_head()
    print(f"specdec up: verifier + eagle and ngram drafters + router for {TARGET} on local Ray …", flush=True)
    started = time.perf_counter()
    failed = True
    try:
        up = json.loads(specdec("up", *UP_ARGS))
        router = first_router(up)
        print(f"  ready in {time.perf_counter() - started:.0f} s: router gRPC {router['grpc']}, HTTP {router['http']}")
        for worker in up["workers"]:
            print(f"  {worker['role']:<9} {worker['address']}")
        print(flush=True)
        run_demo(router, prompts)
        failed = False
    finally:
        print("\nspecdec down …", flush=True)
        try:
            specdec("down", timeout_s=300)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            if not failed:
                raise
            print(f"  specdec down failed too: {error}", file=sys.stderr)  # the first error is the one raised
        else:
            print(f"  done; {time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
