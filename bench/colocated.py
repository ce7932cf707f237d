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

from specdec.cli import encode_prompt
from specdec.drafters import DraftConfig, build_drafter
from specdec.engine import Engine, GenerationRequest, SpecStats
from specdec.models import LoadedModel, load_model, quiet_model_loading
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams

PROMPTS = Path(__file__).parent / "prompts" / "colocated.jsonl"
GREEDY = SamplingParams(temperature=0.0)
DEFAULT_CONFIGS = ("hf-generate", "hf-prompt-lookup", "target-only", "ngram", "early-exit")


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

    def add(self, tokens: list[int], seconds: float, stats: SpecStats | None) -> None:
        self.tokens += len(tokens)
        self.seconds += seconds
        self.outputs.append(tokens)
        if stats is not None:
            self.rounds += stats.rounds
            self.draft_tokens += stats.draft_tokens
            self.accepted_tokens += stats.accepted_tokens
            self.draft_s += stats.draft_s
            self.verify_s += stats.verify_s
            self.state_s += stats.state_s

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


Generate = Callable[[list[int]], tuple[list[int], float, SpecStats | None]]


def engine_generator(engine: Engine, max_tokens: int) -> Generate:
    """Batch-1 greedy generation through our engine: (tokens, seconds, stats)."""

    def generate(prompt: list[int]) -> tuple[list[int], float, SpecStats | None]:
        [result] = engine.generate([GenerationRequest(prompt, GREEDY, max_tokens)])
        return result.token_ids, result.elapsed_s, result.stats

    return generate


def hf_generator(target: LoadedModel, max_tokens: int, **kwargs) -> Generate:
    """Hugging Face ``generate`` (greedy) on the same model object; ``kwargs`` select assisted modes."""
    eos = sorted(target.eos_token_ids)

    def generate(prompt: list[int]) -> tuple[list[int], float, SpecStats | None]:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                **kwargs,
            )
        return out[0, len(prompt) :].tolist(), time.perf_counter() - start, None

    return generate


def compare(generators: dict[str, Generate], prompts: list[list[int]]) -> list[ConfigResult]:
    """Run every configuration on every prompt, interleaved prompt by prompt so drifting machine
    load hits all configurations alike; one warm-up generation per configuration is not counted."""
    for generate in generators.values():
        generate(prompts[0][:8])
    results = {name: ConfigResult(name) for name in generators}
    for prompt in prompts:
        for name, generate in generators.items():
            results[name].add(*generate(prompt))
    return list(results.values())


def build_generators(target: LoadedModel, args: argparse.Namespace, names: list[str]) -> dict[str, Generate]:
    """The named configurations: HF baselines, target-only and each drafter."""
    config = DraftConfig(num_draft_tokens=args.num_draft_tokens)

    def ours(kind: str, **drafter_options) -> Generate:
        drafter = build_drafter(kind, target, config, **drafter_options)
        return engine_generator(Engine(KVRunner(target.model), target.eos_token_ids, drafter), args.max_tokens)

    factories: dict[str, Callable[[], Generate]] = {
        "hf-generate": lambda: hf_generator(target, args.max_tokens),
        "hf-prompt-lookup": lambda: hf_generator(
            target, args.max_tokens, prompt_lookup_num_tokens=args.num_draft_tokens
        ),
        "target-only": lambda: ours("none"),
        "ngram": lambda: ours("ngram"),
        "early-exit": lambda: ours("early-exit", early_exit_layers=args.early_exit_layers),
        "model": lambda: ours("model", draft_model=args.draft_model or target),
    }
    unknown = set(names) - set(factories)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; choose from {sorted(factories)}")
    return {name: factories[name]() for name in names}


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
    parser.add_argument("--draft-model", help="draft for the 'model' config (default: the target itself)")
    parser.add_argument("--early-exit-layers", type=int)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--categories", help="comma-separated prompt categories (default: all)")
    parser.add_argument("--configs", help="comma-separated configs (default: all)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    quiet_model_loading()
    target = load_model(args.target)
    categories = set(args.categories.split(",")) if args.categories else None
    rows = load_prompts(PROMPTS, categories)
    prompts = [encode_prompt(target, row["prompt"], chat=True) for row in rows]
    names = args.configs.split(",") if args.configs else list(DEFAULT_CONFIGS)
    if "target-only" not in names:
        names.append("target-only")
    results = compare(build_generators(target, args, names), prompts)
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
