"""What a long prompt costs an EAGLE drafter, with its head's context window and without.

A round attends over the head KV of at most ``context`` head positions (:mod:`specdec.drafters.eagle`; default
:data:`~specdec.drafters.eagle_head.HEAD_CONTEXT`, the span ``specdec distill`` trains on). Two parts, each
comparing the window (``--contexts``, 0 = the whole text) in one run:

1. **First draft** (``--lengths``): the drafter's work when a sequence drafts for the first time, on a prompt of each
   length: storing the prompt's feature rows (``add_features``) and the first ``propose`` (the head's forward over
   the pending rows). Random feature rows and tokens: the time does not depend on them. Median of ``--repeats``
   fresh sequences, the contexts interleaved.
2. **Long prompts** (needs a trained head): the ``long-context`` prompts of ``bench/prompts/load.jsonl`` (never in
   the training prompts), chat-templated, co-located at batch 1, greedy, a chain of ``--num-draft-tokens``: tokens
   per round, acceptance and tokens/s per context, beside target-only (:func:`bench.eagle.measure`, interleaved
   prompt by prompt), and whether the outputs equal target-only's.
3. **Agreement** (``--agreement-heads``, one or more trained heads): each head's teacher-forced agreement with the
   target's greedy answers as served (:func:`bench.eagle_agreement.teacher_forced_agreement`, the window at its
   default, no prompt lookup) on short held-out prompts, on the same conversations after a long document (a
   ``long-context`` prompt of ``bench/prompts/load.jsonl`` and a one-line reply before them), on those long prompts
   themselves, and on the distillation set's held-out ``long-context`` prompts: whether a head drafts as well far into
   a text as near its start.

Parts: ``--sections`` (default ``first,long``; ``agreement`` needs ``--agreement-heads``).

    python -m bench.eagle_context --draft-model DIR --output-dir bench/results
    python -m bench.eagle_context --sections agreement --agreement-heads DIR_A,DIR_B --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.arguments import comma_ints, comma_names
from bench.eagle import GREEDY, Prompt, head_directory, heldout_conversations, measure, recording_engine
from bench.eagle_agreement import teacher_forced_agreement
from bench.load.report import elide_option, run_metadata, write_report
from specdec.distill.data import encode_chat
from specdec.distill.prompts import LONG_CONTEXT, load_prompt_set
from specdec.drafters import DraftConfig, EagleDrafter
from specdec.drafters.eagle_head import HEAD_CONTEXT, EagleHead, eagle3_layers, load_head
from specdec.engine import GenerationRequest
from specdec.models import load_model
from specdec.sampling import SamplingParams, make_generator

PROMPTS = Path(__file__).resolve().parent / "prompts" / "load.jsonl"
UNBOUNDED = 1 << 30  # a context no text reaches: the whole text, as before the window


def _label(context: int) -> str:
    return "whole text" if context >= UNBOUNDED else f"last {context}"


def first_draft_rows(head: EagleHead, lengths: list[int], contexts: list[int], repeats: int) -> list[dict[str, Any]]:
    """Median seconds of ``add_features`` and of the first ``propose`` per (length, context)."""
    generator = torch.Generator().manual_seed(0)
    times: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for length in lengths:
        for repeat in range(repeats + 1):  # the first pass warms up, uncounted
            for context in contexts if repeat % 2 else reversed(contexts):
                # the head alone: a prompt-lookup round would skip the forward timed here
                drafter = EagleDrafter(head, DraftConfig(num_draft_tokens=3), context=context, lookup_min_match=0)
                prompt = torch.randint(0, head.vocab_size, (length,), generator=generator).tolist()
                rows = torch.randn(length, head.feature_width, generator=generator)
                handle = drafter.open(prompt, SamplingParams(temperature=0.0), make_generator(0))
                started = time.perf_counter()
                drafter.add_features(handle, 0, rows)
                stored = time.perf_counter()
                drafter.propose([handle], [3])
                if repeat:
                    times.setdefault((length, context), []).append((stored - started, time.perf_counter() - stored))
    return [
        {
            "prompt_tokens": length,
            "context": _label(context),
            "add_features_ms": 1e3 * statistics.median(add for add, _ in samples),
            "first_propose_ms": 1e3 * statistics.median(propose for _, propose in samples),
            "total_ms": 1e3 * statistics.median(add + propose for add, propose in samples),
        }
        for (length, context), samples in times.items()
    ]


def long_prompt_texts(count: int) -> list[dict[str, str]]:
    """The first ``count`` ``long-context`` rows of ``bench/prompts/load.jsonl``."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [row for row in rows if row["category"] == LONG_CONTEXT][:count]


def long_prompts(tokenizer: Any, count: int) -> list[Prompt]:
    return [
        Prompt(row["id"], row["category"], encode_chat(tokenizer, [{"role": "user", "content": row["prompt"]}]))
        for row in long_prompt_texts(count)
    ]


AFTER_DOCUMENT = "Thanks, I have read it."  # the reply between the document and the conversation that follows


def agreement_sets(target: Any, count: int) -> dict[str, list[list[int]]]:
    """Prompt token ids per set of the agreement part (see the module docstring)."""
    tokenizer = target.tokenizer
    conversations = [row["messages"] for row in heldout_conversations(count)]
    documents = [row["prompt"] for row in long_prompt_texts(count)]
    after = [
        encode_chat(tokenizer, [{"role": "user", "content": document}, {"role": "assistant", "content": AFTER_DOCUMENT},
                                *messages])
        for document, messages in zip(documents, conversations, strict=False)
    ]  # fmt: skip
    ours = [record.messages for record in load_prompt_set("heldout") if record.category == LONG_CONTEXT][:count]
    return {
        "held-out, short": [encode_chat(tokenizer, messages) for messages in conversations],
        "held-out after a long document": after,
        "long-context (load.jsonl)": [prompt.token_ids for prompt in long_prompts(tokenizer, count)],
        "long-context (distill held-out)": [encode_chat(tokenizer, messages) for messages in ours],
    }


def agreement_rows(
    target: Any, heads: list[Path], sets: dict[str, list[list[int]]], max_tokens: int
) -> list[dict[str, Any]]:
    """Per head and prompt set (:func:`agreement_sets`): teacher-forced agreement as served, and the mean prompt
    length."""
    rows = []
    for directory in heads:
        head, _ = load_head(directory, hidden_size=target.model.config.hidden_size, vocab_size=target.vocab_size)
        drafter = EagleDrafter(head, DraftConfig(num_draft_tokens=1), lookup_min_match=0)
        for name, prompts in sets.items():
            tally = teacher_forced_agreement(target, drafter, prompts, max_tokens).row()
            rows.append(
                {
                    "head": str(directory),
                    "set": name,
                    "prompts": len(prompts),
                    "mean_prompt_tokens": statistics.mean(len(prompt) for prompt in prompts),
                    **tally,
                }
            )
    return rows


def long_prompt_rows(
    target: Any, head: EagleHead, contexts: list[int], prompts: list[Prompt], gamma: int, max_tokens: int
) -> list[dict[str, Any]]:
    configs: dict[str, Any] = {"target-only": (recording_engine(target, None), GREEDY)}
    for context in contexts:
        drafter = EagleDrafter(head, DraftConfig(num_draft_tokens=gamma), context=context, lookup_min_match=0)
        configs[_label(context)] = (recording_engine(target, drafter), GREEDY)
    outputs: dict[str, list[list[int]]] = {name: [] for name in configs}
    for prompt in prompts:  # greedy outputs once per configuration, for the equality column
        for name, (engine, params) in configs.items():
            [result] = engine.generate([GenerationRequest(prompt.token_ids, params, max_tokens, seed=0)])
            outputs[name].append(list(result.token_ids))
    tallies = measure(configs, prompts, max_tokens, "long prompts")
    rows = []
    for name in configs:
        summary = tallies[name]["all"].summary(gamma)
        rows.append(
            {
                "config": name,
                "tokens": summary["tokens"],
                "tokens_per_s": summary["tokens_per_s"],
                "tokens_per_round": summary["tokens_per_round"],
                "acceptance_rate": summary["acceptance_rate"],
                "acc": summary["acc"],
                "draft_ms_per_token": summary["draft_ms_per_token"],
                "same_as_target_only": sum(a == b for a, b in zip(outputs[name], outputs["target-only"], strict=True)),
            }
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_target_only"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return rows


def _f(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(document: dict[str, Any]) -> str:
    meta = document["meta"]
    lines = [
        "# EAGLE drafting on long prompts: the head's context window",
        "",
        f"{meta['date']} · `{' '.join(meta['command'])}`",
        "",
        f"{document['threads']} torch thread(s), float32."
        + (f" Head: `{document['head']}`." if document.get("first_draft") or document.get("long_prompts") else ""),
    ]
    if document.get("first_draft"):
        lines += [
            "",
            "## First draft on a prompt of N tokens (median ms)",
            "",
            "| prompt tokens | head attends over | add_features | first propose | total |",
            "|---|---|---|---|---|",
        ]
    for row in document.get("first_draft", []):
        lines.append(
            f"| {row['prompt_tokens']} | {row['context']} | {_f(row['add_features_ms'], '.1f')} | "
            f"{_f(row['first_propose_ms'], '.1f')} | {_f(row['total_ms'], '.1f')} |"
        )
    if document.get("long_prompts"):
        count, gamma = document["num_prompts"], document["num_draft_tokens"]
        lines += [
            "",
            f"## Long prompts ({count} `long-context` prompts of `bench/prompts/load.jsonl`, "
            f"{document['prompt_tokens_min']}–{document['prompt_tokens_max']} tokens; greedy, chain γ={gamma}, "
            "batch 1, co-located)",
            "",
            "| config | tokens | tokens/s | × target-only | tokens/round | acceptance | acc@1 | draft ms/token "
            "| same tokens as target-only |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in document["long_prompts"]:
            acc1 = row["acc"][0] if row["acc"] else None
            lines.append(
                f"| {row['config']} | {row['tokens']} | {_f(row['tokens_per_s'], '.1f')} | "
                f"{_f(row['vs_target_only'])} | {_f(row['tokens_per_round'])} | {_f(row['acceptance_rate'], '.3f')} | "
                f"{_f(acc1, '.3f')} | {_f(row['draft_ms_per_token'])} | {row['same_as_target_only']}/{count} |"
            )
    if document.get("agreement"):
        lines += [
            "",
            f"## Teacher-forced agreement as served (greedy answers of at most {document['max_tokens']} tokens; "
            f"window {HEAD_CONTEXT}, no prompt lookup)",
            "",
            "| head | prompts | count | mean prompt tokens | positions | agreement | after an agreed position "
            "| outside the draft vocabulary |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in document["agreement"]:
            lines.append(
                f"| `{row['head']}` | {row['set']} | {row['prompts']} | {row['mean_prompt_tokens']:.0f} | "
                f"{row['positions']} | {_f(row['agreement'], '.3f')} | {_f(row['after_agreed'], '.3f')} | "
                f"{_f(row['outside_draft_vocab'], '.3f')} |"
            )
    if document.get("note"):
        lines += ["", document["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft-model", help="head directory (default: the cached head for --target)")
    parser.add_argument("--contexts", type=comma_ints, default=[HEAD_CONTEXT, 0], help="0: the whole text")
    parser.add_argument("--lengths", type=comma_ints, default=[256, 640, 1280, 2560])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8, help="long prompts (0: first-draft part only)")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="eagle-context")
    parser.add_argument("--note", default="")
    parser.add_argument("--sections", type=comma_names, default=["first", "long"], help="of first,long,agreement")
    parser.add_argument("--agreement-heads", type=comma_names, default=[], help="head directories (agreement)")
    args = parser.parse_args(argv)
    if "agreement" in args.sections and not args.agreement_heads:
        parser.error("--sections agreement needs --agreement-heads")
    recorded = argv if argv is not None else sys.argv[1:]
    torch.set_num_threads(args.threads)
    contexts = [context or UNBOUNDED for context in args.contexts]
    target = load_model(args.target)
    directory = head_directory(args.target, args.draft_model)
    trained = directory.is_dir()
    if trained:
        head, _ = load_head(directory, hidden_size=target.model.config.hidden_size, vocab_size=target.vocab_size)
    else:  # the first-draft times do not depend on the weights
        layers = eagle3_layers(int(target.model.config.num_hidden_layers))
        head = EagleHead.from_target(target.model, torch.arange(8192), feature_layers=layers).eval()
    config = {key: str(value) for key, value in vars(args).items()}
    document: dict[str, Any] = {
        "meta": run_metadata(
            args.name, ["python", "-m", "bench.eagle_context", *elide_option(recorded, "--note")], config
        ),
        "head": str(directory) if trained else "untrained (none cached), first-draft part only",
        "threads": args.threads,
        "note": args.note,
    }
    if "first" in args.sections:
        document["first_draft"] = first_draft_rows(head, args.lengths, contexts, args.repeats)
        write_report(args.output_dir, args.name, document, markdown(document))
    if "long" in args.sections and trained and args.num_prompts:
        prompts = long_prompts(target.tokenizer, args.num_prompts)
        lengths = [len(prompt.token_ids) for prompt in prompts]
        document.update(
            num_prompts=len(prompts),
            num_draft_tokens=args.num_draft_tokens,
            prompt_tokens_min=min(lengths),
            prompt_tokens_max=max(lengths),
        )
        document["long_prompts"] = long_prompt_rows(
            target, head, contexts, prompts, args.num_draft_tokens, args.max_tokens
        )
        write_report(args.output_dir, args.name, document, markdown(document))
    if "agreement" in args.sections:
        heads = [Path(head).expanduser() for head in args.agreement_heads]
        document["max_tokens"] = args.max_tokens
        sets = agreement_sets(target, args.num_prompts)
        document["agreement"] = agreement_rows(target, heads, sets, args.max_tokens)
        write_report(args.output_dir, args.name, document, markdown(document))


if __name__ == "__main__":
    main()
