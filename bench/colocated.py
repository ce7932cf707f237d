"""Co-located comparison in one run: target-only vs each drafter vs Hugging Face ``generate``.

Greedy decoding on the same prompts (chat template applied), batch size 1, one warm-up request
per configuration excluded from timing. Writes ``colocated.json`` and ``colocated.md``.

    python -m bench.colocated --target smollm2-135m --max-tokens 128 --output-dir bench/results
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

from specdec.cli import encode_prompt, quiet_model_loading
from specdec.drafters import DraftConfig, build_drafter
from specdec.engine import Engine, GenerationRequest
from specdec.models import LoadedModel, load_model
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams

PROMPTS = Path(__file__).parent / "prompts" / "colocated.jsonl"
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class ConfigResult:
    """Totals of one configuration over the prompt set."""

    name: str
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    state_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.accepted_tokens / self.rounds if self.rounds else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def load_prompts(path: Path, categories: set[str] | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if categories is None or row["category"] in categories]


def run_engine(name: str, engine: Engine, prompts: list[list[int]], max_tokens: int) -> ConfigResult:
    """Generate each prompt alone (batch 1) after one warm-up request."""
    engine.generate([GenerationRequest(prompts[0], GREEDY, 8)])
    result = ConfigResult(name)
    for prompt in prompts:
        [generated] = engine.generate([GenerationRequest(prompt, GREEDY, max_tokens)])
        stats = generated.stats
        result.tokens += len(generated.token_ids)
        result.seconds += generated.elapsed_s
        result.rounds += stats.rounds
        result.draft_tokens += stats.draft_tokens
        result.accepted_tokens += stats.accepted_tokens
        result.draft_s += stats.draft_s
        result.verify_s += stats.verify_s
        result.state_s += stats.state_s
        result.outputs.append(generated.token_ids)
    return result


def run_hf_generate(
    name: str, target: LoadedModel, prompts: list[list[int]], max_tokens: int, **kwargs
) -> ConfigResult:
    """Hugging Face ``generate`` (greedy) on the same model object; ``kwargs`` select assisted modes."""
    model = target.model

    def generate(prompt: list[int], new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=sorted(target.eos_token_ids),
                pad_token_id=sorted(target.eos_token_ids)[0],
                **kwargs,
            )
        return out[0, len(prompt) :].tolist()

    generate(prompts[0], 8)
    result = ConfigResult(name)
    for prompt in prompts:
        start = time.perf_counter()
        tokens = generate(prompt, max_tokens)
        result.seconds += time.perf_counter() - start
        result.tokens += len(tokens)
        result.outputs.append(tokens)
    return result


def build_runs(target: LoadedModel, args: argparse.Namespace) -> dict[str, Callable[[list[list[int]]], ConfigResult]]:
    """Every configuration by name; each returns its totals over the prompts."""
    config = DraftConfig(num_draft_tokens=args.num_draft_tokens)

    def engine_run(name: str, kind: str, **drafter_options) -> Callable[[list[list[int]]], ConfigResult]:
        def run(prompts: list[list[int]]) -> ConfigResult:
            drafter = build_drafter(kind, target, config, **drafter_options)
            return run_engine(
                name, Engine(KVRunner(target.model), target.eos_token_ids, drafter), prompts, args.max_tokens
            )

        return run

    runs = {
        "hf-generate": lambda prompts: run_hf_generate("hf-generate", target, prompts, args.max_tokens),
        "hf-prompt-lookup": lambda prompts: run_hf_generate(
            "hf-prompt-lookup", target, prompts, args.max_tokens, prompt_lookup_num_tokens=args.num_draft_tokens
        ),
        "target-only": engine_run("target-only", "none"),
        "ngram": engine_run("ngram", "ngram"),
        "early-exit": engine_run("early-exit", "early-exit", early_exit_layers=args.early_exit_layers),
    }
    if args.draft_model:
        runs["model"] = engine_run("model", "model", draft_model=args.draft_model)
    return runs


def markdown(results: list[ConfigResult], meta: dict) -> str:
    baseline = next(r for r in results if r.name == "target-only")
    hf = next((r for r in results if r.name == "hf-generate"), None)
    lines = [
        f"# Co-located speculation on `{meta['target']}`",
        "",
        f"{meta['date']} · {meta['machine']} · torch {meta['torch']} · transformers {meta['transformers']} · "
        f"greedy, float32, batch 1, max {meta['max_tokens']} new tokens, γ = {meta['num_draft_tokens']}, "
        f"{meta['num_prompts']} prompts ({', '.join(meta['categories'])})",
        "",
        "| config | tokens | tokens/s | × target-only | × HF generate | mean accepted length | acceptance rate "
        "| draft s | verify s | state s | same tokens as target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        same = sum(a == b for a, b in zip(r.outputs, baseline.outputs, strict=True))
        lines.append(
            f"| {r.name} | {r.tokens} | {r.tokens_per_s:.1f} | {r.tokens_per_s / baseline.tokens_per_s:.2f} | "
            + (f"{r.tokens_per_s / hf.tokens_per_s:.2f}" if hf else "–")
            + f" | {_fmt(r.mean_accepted_length)} | {_fmt(r.acceptance_rate)} | {r.draft_s:.2f} | {r.verify_s:.2f} | "
            f"{r.state_s:.3f} | {same}/{len(r.outputs)} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft-model", help="also run the model drafter with this draft")
    parser.add_argument("--early-exit-layers", type=int)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--categories", help="comma-separated prompt categories (default: all)")
    parser.add_argument("--configs", help="comma-separated configs (default: all)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    quiet_model_loading()
    target = load_model(args.target)
    categories = set(args.categories.split(",")) if args.categories else None
    rows = load_prompts(PROMPTS, categories)
    prompts = [encode_prompt(target, row["prompt"], chat=True) for row in rows]
    runs = build_runs(target, args)
    names = args.configs.split(",") if args.configs else list(runs)
    if "target-only" not in names:
        names.append("target-only")
    results = []
    for name in names:
        result = runs[name](prompts)
        print(f"{name:>18}: {result.tokens} tokens, {result.tokens_per_s:.1f} tokens/s", flush=True)
        results.append(result)
    meta = {
        "target": args.target,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "max_tokens": args.max_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "num_prompts": len(prompts),
        "categories": sorted({row["category"] for row in rows}),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = "colocated" + (f"-{'-'.join(sorted(categories))}" if categories else "")
    report = markdown(results, meta)
    (args.output_dir / f"{stem}.md").write_text(report)
    payload = {"meta": meta, "results": [_result_json(r) for r in results]}
    (args.output_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(report)


def _result_json(result: ConfigResult) -> dict:
    return {
        "name": result.name,
        "tokens": result.tokens,
        "seconds": result.seconds,
        "tokens_per_s": result.tokens_per_s,
        "rounds": result.rounds,
        "draft_tokens": result.draft_tokens,
        "accepted_tokens": result.accepted_tokens,
        "mean_accepted_length": result.mean_accepted_length,
        "acceptance_rate": result.acceptance_rate,
        "draft_s": result.draft_s,
        "verify_s": result.verify_s,
        "state_s": result.state_s,
    }


if __name__ == "__main__":
    main()
