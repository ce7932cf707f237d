"""``make demo``: a few real prompts on smollm2-135m, with and without speculation.

Greedy, so every configuration must print the same tokens; the table shows what speculation
bought. Runs in about a minute on two CPU cores.
"""

from __future__ import annotations

from bench.colocated import PROMPTS, compare, engine_generator, load_prompts
from specdec.cli import encode_prompt, quiet_model_loading
from specdec.drafters import DraftConfig, build_drafter
from specdec.engine import Engine
from specdec.models import load_model
from specdec.runner import KVRunner

TARGET = "smollm2-135m"
MAX_TOKENS = 96


def main() -> None:
    quiet_model_loading()
    target = load_model(TARGET)
    rows = load_prompts(PROMPTS, None)
    chosen = [next(row for row in rows if row["category"] == category) for category in ("code", "rewrite", "chat")]
    prompts = [encode_prompt(target, row["prompt"], chat=True) for row in chosen]
    generators = {}
    for name, kind in (("target-only", "none"), ("ngram", "ngram"), ("early-exit", "early-exit")):
        drafter = build_drafter(kind, target, DraftConfig(num_draft_tokens=4))
        generators[name] = engine_generator(Engine(KVRunner(target.model), target.eos_token_ids, drafter), MAX_TOKENS)
    results = compare(generators, prompts)
    baseline = results[0]
    for row, tokens in zip(chosen, baseline.outputs, strict=True):
        answer = target.tokenizer.decode(tokens, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"[{row['category']}] {row['prompt'].splitlines()[0][:60]}…\n  → {answer[:160]}…\n")
    print(f"{'drafter':<12} {'tokens':>6} {'tokens/s':>9} {'speed-up':>9} {'accepted len':>13} {'same tokens':>12}")
    for result in results:
        same = sum(a == b for a, b in zip(result.outputs, baseline.outputs, strict=True))
        accepted = result.mean_accepted_length or 1.0
        print(
            f"{result.name:<12} {result.tokens:>6} {result.tokens_per_s:>9.1f} "
            f"{result.tokens_per_s / baseline.tokens_per_s:>8.2f}x {accepted:>13.2f} {same:>8}/{len(prompts)}"
        )


if __name__ == "__main__":
    main()
