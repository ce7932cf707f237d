"""Drive the router's OpenAI API, unchanged, with a third-party load client (GuideLLM) and with `specdec bench` at
the same rate and prompts, and write the two reports side by side.

Why: our load generator and its metric definitions are ours; a widely used external client hitting the same
HTTP endpoints is the check that the API is really OpenAI-compatible (streaming, usage, text parts) and that our
TTFT/ITL/e2e numbers are in line with what someone else's tool measures.

One command (as root, for the private network namespace; needs PyPI once, for the tool's own venv):

    .venv/bin/python bench/thirdparty.py

1. outside any namespace: install `guidellm` into `.venv-guidellm/` (idempotent; torch first so the CPU wheel is
   the one kept) and save the SmolLM2 tokenizer next to it, so the tool tokenizes offline;
2. re-run itself inside `unshare -n` with only loopback up (Ray otherwise binds the host's IP), `specdec up`,
   two unmeasured warm-up requests, GuideLLM at a constant rate, `specdec bench` at the same rate and prompts,
   and `specdec down` in a `finally`;
3. write `bench/results/thirdparty.md` plus the raw reports `thirdparty-guidellm.json` / `thirdparty-ours.json`.

`--base-url http://HOST:PORT` skips steps 2's up/down and uses a router that is already running.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOL = "guidellm"
TOOL_VERSION = "0.8.1"
# torch first and alone: pip's config here constrains it to the local CPU wheel; installing guidellm afterwards
# with the same pin keeps the resolver from swapping in a CUDA build (guidellm itself pulls no nvidia-* wheels).
INSTALL_STEPS: tuple[tuple[str, ...], ...] = (("torch==2.13.0",), (f"{TOOL}=={TOOL_VERSION}", "torch==2.13.0"))
MODEL = "smollm2-135m"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def log(message: str) -> None:
    print(f"[thirdparty {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- install (needs the network: outside the namespace) ---------------------------------------------------------


def install(venv: Path) -> None:
    """Create the tool's own venv once; a stamp with the pins makes a rerun a no-op and a pin change a reinstall."""
    stamp = venv / ".thirdparty-installed"
    wanted = json.dumps(INSTALL_STEPS)
    if stamp.exists() and stamp.read_text() == wanted:
        return
    log(f"installing {TOOL}=={TOOL_VERSION} into {venv}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for step in INSTALL_STEPS:
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", *step], check=True)
    stamp.write_text(wanted)


def save_tokenizer(directory: Path) -> None:
    """The tool loads a tokenizer by path; the model hub is not reachable, so give it ours on disk."""
    if (directory / "tokenizer.json").exists():
        return
    from specdec.model_files import load_tokenizer

    load_tokenizer(MODEL).save_pretrained(str(directory))


# --- the stack ----------------------------------------------------------------------------------------------------


def specdec(*args: str, env: dict[str, str], timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "specdec"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@contextmanager
def stack(drafter_kind: str, work: Path) -> Iterator[str]:
    """`specdec up` with a private state file (other sessions may run their own), yield the HTTP base URL,
    `specdec down` whatever happened."""
    env = {
        **os.environ,
        **OFFLINE_ENV,
        "SPECDEC_STATE_FILE": str(work / "cluster.json"),
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    try:
        log(f"specdec up --drafter-kind {drafter_kind}")
        started = specdec("up", "--drafter-kind", drafter_kind, env=env)
        if started.returncode != 0:
            raise RuntimeError(f"specdec up failed ({started.returncode}):\n{started.stderr[-4000:]}")
        status = specdec("status", "--json", env=env, timeout_s=60)
        router = json.loads(status.stdout)["router"]
        log(f"router {router}")
        yield f"http://{router['http']}"
    finally:
        if (work / "cluster.json").exists():
            log("specdec down")
            stopped = specdec("down", env=env, timeout_s=300)
            if stopped.returncode != 0:
                log(f"specdec down failed ({stopped.returncode}): {stopped.stderr[-2000:]}")


def warm_up(base_url: str, count: int = 2) -> None:
    """Unmeasured requests so neither client pays for the first compile/allocation after start-up."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
    for _ in range(count):
        request = urllib.request.Request(
            f"{base_url}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()


# --- the two clients ----------------------------------------------------------------------------------------------


def write_tool_prompts(prompts_path: Path, num_requests: int, seed: int, out: Path) -> list[str]:
    """The exact prompts `specdec bench` will send, in its order (its seeded shuffle), as a one-column JSONL for
    the tool, which sends rows in file order; so both clients send the same N prompts."""
    from bench.load.workload import PromptCycle, load_prompts

    cycle = PromptCycle(load_prompts(prompts_path), seed)
    chosen = [cycle[i] for i in range(num_requests)]
    out.write_text("".join(json.dumps({"prompt": p.text}, ensure_ascii=False) + "\n" for p in chosen))
    return [p.id for p in chosen]


def run_guidellm(args: argparse.Namespace, base_url: str, data: Path, work: Path) -> dict[str, Any]:
    """One constant-rate benchmark through the tool's scenario file (every option in one reviewable JSON)."""
    report = work / "guidellm.json"
    scenario = {
        "metadata": {"labels": {"system": "specdec", "prompts": str(args.prompts)}},
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base_url,
                "model": MODEL,
                "request_format": "/v1/chat/completions",
                "stream": True,
                "max_tokens": args.max_tokens,
                "timeout": 600,
                "extras": {"body": {"temperature": 0.0}},  # greedy, as `specdec bench` sends by default
            },
            "profile": {"kind": "constant", "rate": [args.qps]},
            "constraints": [{"kind": "max_requests", "count": args.num_requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(args.venv / "smollm2-tokenizer")},
            "data": [{"kind": "json_file", "path": str(data)}],
            "seed": {"kind": "static", "value": args.seed},
            "outputs": [{"kind": "json", "path": str(report)}, {"kind": "console"}],
        },
    }
    (work / "guidellm-scenario.json").write_text(json.dumps(scenario, indent=2))
    command = [str(args.venv / "bin" / "guidellm"), "run", "-c", str(work / "guidellm-scenario.json")]
    command.append("--disable-progress")
    log(f"{TOOL}: {args.num_requests} requests at {args.qps} req/s (constant)")
    with open(work / "guidellm.log", "w") as out:
        done = subprocess.run(command, env={**os.environ, **OFFLINE_ENV}, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not report.exists():
        tail = (work / "guidellm.log").read_text()[-4000:]
        raise RuntimeError(f"{TOOL} failed ({done.returncode}):\n{tail}")
    return json.loads(report.read_text())


def run_ours(args: argparse.Namespace, base_url: str, work: Path) -> dict[str, Any] | None:
    """`specdec bench` at the same load; None (with the reason logged) when that command is not available."""
    specdec_bin = str(ROOT / ".venv" / "bin" / "specdec")
    probe = subprocess.run([specdec_bin, "bench", "--help"], cwd=ROOT, capture_output=True, text=True)
    if probe.returncode != 0:
        log("SKIPPED ours: `specdec bench` is not available in this checkout (`specdec bench --help` failed)")
        return None
    result_dir = work / "ours"
    command = [specdec_bin, "bench", "--backend", "http", "--base-url", base_url, "--qps", str(args.qps)]
    command += ["--arrival", "constant", "--num-requests", str(args.num_requests)]
    command += ["--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts)]
    command += ["--result-dir", str(result_dir), "--name", "ours", "--no-progress"]
    # Options the brief's command leaves to defaults, made explicit when this version of the CLI has them.
    for flag, value in (("--seed", str(args.seed)), ("--temperature", "0"), ("--no-plots", None)):
        if flag in probe.stdout:
            command += [flag] if value is None else [flag, value]
    log("ours: " + shlex.join(command))
    with open(work / "ours.log", "w") as out:
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE_ENV}, stdout=out, stderr=out)
    if done.returncode != 0 or not (result_dir / "ours.json").exists():
        log(f"ours failed ({done.returncode}):\n{(work / 'ours.log').read_text()[-4000:]}")
        return None
    return json.loads((result_dir / "ours.json").read_text())


# --- the report ---------------------------------------------------------------------------------------------------


def _stat(metric: dict[str, Any], key: str, scale: float = 1.0) -> float | None:
    successful = metric.get("successful") or {}
    value = successful.get(key) if key in ("mean", "median") else (successful.get("percentiles") or {}).get(key)
    return None if value is None else value * scale


def guidellm_row(report: dict[str, Any]) -> dict[str, float | int | None]:
    """The numbers of the tool's one benchmark under our key names (ms; rates per s). Its ITL is our TPOT."""
    metrics = report["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    return {
        "completed": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"],
        "duration": report["benchmarks"][0]["duration"],
        "request_throughput": _stat(metrics["requests_per_second"], "mean"),
        "output_throughput": _stat(metrics["output_tokens_per_second"], "mean"),
        "output_tokens_median": _stat(metrics["output_token_count"], "median"),
        "median_ttft_ms": _stat(metrics["time_to_first_token_ms"], "median"),
        "p95_ttft_ms": _stat(metrics["time_to_first_token_ms"], "p95"),
        "median_tpot_ms": _stat(metrics["inter_token_latency_ms"], "median"),
        "p95_tpot_ms": _stat(metrics["inter_token_latency_ms"], "p95"),
        "median_itl_ms": None,
        "p95_itl_ms": None,
        "median_tpot_incl_first_ms": _stat(metrics["time_per_output_token_ms"], "median"),
        "median_e2el_ms": _stat(metrics["request_latency"], "median", 1e3),
        "p95_e2el_ms": _stat(metrics["request_latency"], "p95", 1e3),
    }


def ours_row(summary: dict[str, Any] | None) -> dict[str, Any]:
    if summary is None:
        return {}
    row = {key: summary.get(key) for key in ("completed", "failed", "duration", "request_throughput")}
    row["output_throughput"] = summary.get("output_throughput")
    lens = sorted(summary.get("output_lens") or [])
    row["output_tokens_median"] = (lens[(len(lens) - 1) // 2] + lens[len(lens) // 2]) / 2 if lens else None
    for name in ("ttft", "itl", "tpot", "e2el"):
        row[f"median_{name}_ms"] = summary.get(f"median_{name}_ms")
        row[f"p95_{name}_ms"] = summary.get(f"p95_{name}_ms")
    return row


def output_agreement(theirs: dict[str, Any], ours: dict[str, Any] | None, prompts: Path) -> tuple[int, int] | None:
    """Per prompt, did both clients get the same number of output tokens? Greedy decoding of the same prompt
    through the same API must give the same text, so anything but all-equal means the two clients did not send
    the same request (template, options, text parts)."""
    if ours is None:
        return None
    texts = {}
    for line in prompts.read_text().splitlines():
        row = json.loads(line)
        texts[row.get("id")] = row["prompt"]
    by_text = {}
    for request in theirs["benchmarks"][0]["requests"]["successful"]:
        content = json.loads(request["request_args"])["body"]["messages"][0]["content"]
        text = content if isinstance(content, str) else "".join(part["text"] for part in content)
        by_text[text] = request["output_tokens"]
    measured = [r for r in ours.get("requests", []) if not r.get("warmup") and r.get("error") is None]
    same = sum(by_text.get(texts.get(r["prompt_id"])) == r["output_tokens"] for r in measured)
    return same, len(measured)


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return commit + (" + uncommitted changes" if git("status", "--porcelain") else "")


ROWS: tuple[tuple[str, str, int], ...] = (
    ("requests completed", "completed", 0),
    ("requests failed", "failed", 0),
    ("measured window (s)", "duration", 1),
    ("request throughput (req/s)", "request_throughput", 3),
    ("output throughput (tok/s)", "output_throughput", 1),
    ("output tokens per request, median", "output_tokens_median", 0),
    ("TTFT median (ms)", "median_ttft_ms", 1),
    ("TTFT p95 (ms)", "p95_ttft_ms", 1),
    ('per-token latency after the first, median (ms): theirs "ITL", ours TPOT', "median_tpot_ms", 1),
    ('per-token latency after the first, p95 (ms): theirs "ITL", ours TPOT', "p95_tpot_ms", 1),
    ("gap between streamed chunks, median (ms): ours ITL", "median_itl_ms", 1),
    ("gap between streamed chunks, p95 (ms): ours ITL", "p95_itl_ms", 1),
    ("e2e latency median (ms)", "median_e2el_ms", 1),
    ("e2e latency p95 (ms)", "p95_e2el_ms", 1),
)


def write_report(
    args: argparse.Namespace, theirs: dict[str, Any], ours: dict[str, Any] | None, prompt_ids: list[str]
) -> Path:
    """thirdparty.md plus both raw JSON reports, so every number in the table can be traced back."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "thirdparty-guidellm.json").write_text(json.dumps(theirs, indent=1))
    if ours is not None:
        (args.out_dir / "thirdparty-ours.json").write_text(json.dumps(ours, indent=1))
    t, o = guidellm_row(theirs), ours_row(ours)
    from bench.load.report import cpu_model

    cpu, cores = cpu_model(), os.cpu_count()
    measured_at = datetime.fromtimestamp(theirs["benchmarks"][0]["start_time"], UTC)
    table = ["| metric | GuideLLM (theirs) | specdec bench (ours) |", "|---|---:|---:|"]
    for label, key, digits in ROWS:
        ours_cell = _fmt(o.get(key), digits) if o else "not run"
        table.append(f"| {label} | {_fmt(t.get(key), digits)} | {ours_cell} |")
    if args.base_url:
        server = f"a router already running at {args.base_url} (`--base-url`)"
    else:
        server = f"`specdec up --drafter-kind {args.drafter_kind}`, router default speculation, on the same machine"
    agreement = output_agreement(theirs, ours, args.prompts)
    lines = [
        "# Third-party load client (GuideLLM) vs `specdec bench`",
        "",
        f"- Date: {measured_at.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Hardware: {cpu}, {cores} cores; load clients and server on the same machine"
        + (f". {args.note}" if args.note else ""),
        f"- Versions: {TOOL} {theirs.get('metadata', {}).get('guidellm_version', TOOL_VERSION)} in its own venv "
        f"`{args.venv.name}/` (pins: {'; '.join(' '.join(step) for step in INSTALL_STEPS)}), "
        f"specdec commit {_commit()}",
        f"- Server: {server}",
        f"- Load: {args.num_requests} requests at a constant {args.qps} req/s, streamed `/v1/chat/completions`, "
        f"model `{MODEL}`, `max_tokens` {args.max_tokens}, temperature 0, EOS honoured",
        f"- Prompts: the first {args.num_requests} of `specdec bench`'s seeded shuffle (seed {args.seed}) of "
        f"`{args.prompts.relative_to(ROOT) if args.prompts.is_relative_to(ROOT) else args.prompts}`, "
        f"sent in the same order by both clients ({', '.join(prompt_ids[:5])}, ...)",
        f"- Order: two unmeasured warm-up requests, then {TOOL}, then ours (which sends its own 2 warm-ups)",
    ]
    if agreement is not None:
        lines.append(
            f"- Same output length per prompt from both clients (greedy, so same request ⇒ same tokens): "
            f"{agreement[0]}/{agreement[1]}"
        )
    else:
        lines.append("- **Ours was not run**: `specdec bench` was not available (or failed); see the log.")
    lines += ["", *table, ""]
    lines.append(
        "Raw reports: `thirdparty-guidellm.json` (the tool's JSON)"
        + (", `thirdparty-ours.json` (`specdec bench`)." if ours is not None else ".")
    )
    lines += [
        "",
        "## Definitions (where they differ)",
        "",
        "- **TTFT**: both measure request sent → first streamed chunk carrying output text.",
        f'- **Per-token latency**: {TOOL}\'s "ITL" is, per request, (last token − first token) / (output tokens − 1);'
        " its median/p95 are over those per-request values weighted by token count. Ours is the same per-request"
        " quantity under vLLM's name, TPOT, with each request weighted once.",
        "- **Our ITL** is every gap between consecutive streamed chunks of every request, pooled. With speculative"
        " decoding one chunk can carry several accepted tokens, so it is a per-round gap; the tool has no such"
        " figure.",
        f'- {TOOL}\'s own "TPOT" is (last token − request start) / output tokens, i.e. it includes the TTFT '
        f"(median here {_fmt(t.get('median_tpot_incl_first_ms'))} ms); not in the table.",
        f"- **Throughput**: {TOOL} reports the mean of its request and output-token rate series over its window;"
        " ours is completed requests (output tokens) / measured window (first request due → last one finished)."
        " Output-token counts are the server's `usage` figures in both.",
        f"- **Percentiles**: {TOOL} reports sample percentiles (values from the data); ours interpolate linearly"
        f" between closest ranks (numpy's default). With {args.num_requests} requests a p95 is one or two requests.",
        f"- **Failed**: {TOOL} counts errored + incomplete requests; ours counts every error, timeouts included.",
        "",
        "Rerun (as root: it installs the tool on first use, then runs offline in a private network namespace):",
        "",
        "```",
        args.rerun_command,
        "```",
        "",
    ]
    path = args.out_dir / "thirdparty.md"
    path.write_text("\n".join(lines))
    return path


# --- main ---------------------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, base_url: str, work: Path) -> Path:
    data = work / "guidellm-prompts.jsonl"
    prompt_ids = write_tool_prompts(args.prompts, args.num_requests, args.seed, data)
    log(f"warm-up against {base_url}")
    warm_up(base_url)
    theirs = run_guidellm(args, base_url, data, work)
    ours = None if args.skip_ours else run_ours(args, base_url, work)
    return write_report(args, theirs, ours, prompt_ids)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running router's HTTP address (default: start one with `specdec up`)")
    parser.add_argument("--qps", type=float, default=0.5)
    parser.add_argument("--num-requests", type=int, default=36)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="prompt shuffle seed shared by both clients")
    parser.add_argument("--prompts", type=Path, default=ROOT / "bench" / "prompts" / "load.jsonl")
    parser.add_argument("--drafter-kind", default="ngram", help="passed to `specdec up`")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-guidellm", help="the tool's own venv")
    parser.add_argument("--work-dir", type=Path, help="keep logs and raw outputs here (default: a temp dir)")
    parser.add_argument("--skip-ours", action="store_true", help="run only the third-party tool")
    parser.add_argument("--install-only", action="store_true", help="install the tool and the tokenizer, then stop")
    parser.add_argument("--note", default="", help="conditions of this run, printed under Hardware in the report")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite thirdparty.md from the raw JSON reports in --out-dir"
    )
    parser.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.prompts, args.out_dir, args.venv = args.prompts.resolve(), args.out_dir.resolve(), args.venv.resolve()
    return args


def rerun_command(argv: list[str]) -> str:
    """The command line to print in the report: this one, less the internal and run-specific options."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg in ("--in-namespace", "--report-only"):
            skip = False
            continue
        if arg in ("--work-dir", "--note"):
            skip = True
            continue
        if not arg.startswith(("--work-dir=", "--note=")):
            kept.append(arg)
    return shlex.join([".venv/bin/python", "bench/thirdparty.py", *kept])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.rerun_command = rerun_command(argv)
    if args.report_only:
        ours_path = args.out_dir / "thirdparty-ours.json"
        theirs = json.loads((args.out_dir / "thirdparty-guidellm.json").read_text())
        ours = json.loads(ours_path.read_text()) if ours_path.exists() else None
        with tempfile.TemporaryDirectory() as temp:
            prompt_ids = write_tool_prompts(args.prompts, args.num_requests, args.seed, Path(temp) / "p.jsonl")
        print(write_report(args, theirs, ours, prompt_ids).read_text())
        return 0
    if not args.in_namespace:
        install(args.venv)
        save_tokenizer(args.venv / "smollm2-tokenizer")
        if args.install_only:
            return 0
        if not args.base_url:
            # Ray binds the host's IP unless loopback is the only interface: redo the rest in a fresh namespace.
            if shutil.which("unshare") is None:
                raise SystemExit("needs `unshare` (util-linux) and root, or --base-url of a running router")
            inner = shlex.join([sys.executable, str(Path(__file__).resolve()), *argv, "--in-namespace"])
            return subprocess.run(["unshare", "-n", "bash", "-c", f"ip link set lo up && exec {inner}"]).returncode
    with tempfile.TemporaryDirectory(prefix="thirdparty-") as temp:
        work = args.work_dir.resolve() if args.work_dir else Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        if args.base_url:
            path = measure(args, args.base_url.rstrip("/"), work)
        else:
            with stack(args.drafter_kind, work) as base_url:
                path = measure(args, base_url, work)
    log(f"wrote {path}")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
