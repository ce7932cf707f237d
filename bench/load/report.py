"""Write a load run's results: ``NAME.json`` (summary + every request, schema ``bench/load/schema.json``),
``NAME.md`` (the DESIGN §7 table, labelled with hardware, versions and date) and the charts of
:mod:`bench.load.plots`; for several points one JSON/Markdown pair per point (``NAME-LABEL.json/.md``) and
``NAME-sweep.json/.md`` with every point's row and the target QPS per speculation mode.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.load.plots import plot_acceptance, plot_latency_cdfs, plot_round_split, plot_sweep
from bench.load.summary import Slo
from bench.load.sweep import SATURATION_RULE, Point, mode_name, target_qps

SCHEMA_PATH = Path(__file__).with_name("schema.json")
SCHEMA_VERSION = 1
_ROOT = Path(__file__).resolve().parents[2]
_LIST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors")


# --- labels ---------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for labelling results."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Hardware and versions of the machine running the load generator (the router may run elsewhere)."""
    import torch

    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "grpcio", "aiohttp", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    commit, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    versions["specdec_commit"] = None if commit is None else commit.strip() + ("+dirty" if status else "")
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "gpus": gpus,
        "platform": platform.platform(),
        "versions": versions,
    }


def elide_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` with the value of ``option`` (``--opt VALUE`` or ``--opt=VALUE``) shown as ``…``: a long free-text
    value (a note printed on its own) stays out of the recorded command line."""
    kept: list[str] = []
    elide = False
    for arg in argv:
        if elide:
            kept.append("…")
            elide = False
        elif arg == option:
            kept.append(arg)
            elide = True
        else:
            kept.append(f"{option}=…" if arg.startswith(f"{option}=") else arg)
    return kept


def run_metadata(name: str, command: Sequence[str], config: dict[str, Any]) -> dict[str, Any]:
    """The label every result file carries: name, date, the full command and configuration, environment."""
    return {
        "name": name,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": list(command),
        "config": config,
        "environment": environment(),
    }


# --- JSON -----------------------------------------------------------------------------------------------------


def point_document(point: Point, meta: dict[str, Any]) -> dict[str, Any]:
    """``NAME.json``: metadata, the summary, the metrics delta and every request (warm-up flagged)."""
    run, summary = point
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "point",
        **meta,
        **summary,
        "metrics": None if run.metrics is None else [sample.to_json() for sample in run.metrics],
        "requests": [record.to_json() for record in run.records],
    }


def sweep_document(
    points: Sequence[Point], meta: dict[str, Any], slo: Slo | None, stopped: dict[str, str]
) -> dict[str, Any]:
    """``NAME-sweep.json``: metadata, every point's summary (without per-request lists), target QPS per mode."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "sweep",
        **meta,
        "saturation_rule": SATURATION_RULE,
        "slo": None if slo is None else {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
        "target_qps": targets(points, slo),
        "stopped": stopped,
        "points": [{k: v for k, v in summary.items() if k not in _LIST_KEYS} for _, summary in points],
    }


def targets(points: Sequence[Point], slo: Slo | None) -> dict[str, float | None]:
    """Target QPS per speculation mode (see :func:`bench.load.sweep.target_qps`); empty without an SLO."""
    if slo is None or (slo.ttft_ms is None and slo.itl_ms is None):
        return {}
    modes = dict.fromkeys(mode_name(summary["speculation"]) for _, summary in points)
    return {mode: target_qps([s for _, s in points if mode_name(s["speculation"]) == mode], slo) for mode in modes}


# --- Markdown -------------------------------------------------------------------------------------------------


def _f(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    return format(value, spec) if isinstance(value, float | int) and not isinstance(value, bool) else str(value)


def _header(meta: dict[str, Any]) -> list[str]:
    env = meta["environment"]
    versions = " · ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    gpus = ", ".join(env["gpus"]) or "no GPU"
    config = meta["config"]
    return [
        f"# `specdec bench` {meta['name']}",
        "",
        f"{meta['date']} · {env['cpu']} ({env['cpus']} CPUs, load {env['load_average'][0]:.2f}) · {gpus} · {versions}",
        "",
        f"Target `{config.get('model') or 'router default'}` via {config.get('backend')}, prompts "
        f"`{config.get('prompts')}`, max {config.get('max_tokens')} tokens, temperature {config.get('temperature')}, "
        f"ignore_eos {config.get('ignore_eos')}, seed {config.get('seed')}. Command: `{' '.join(meta['command'])}`",
        "",
    ]


def _load(summary: dict[str, Any]) -> str:
    if summary["concurrency"] is not None:
        return f"closed loop, {summary['concurrency']} concurrent"
    cap = f", max {summary['max_concurrency']} in flight" if summary["max_concurrency"] else ""
    return f"{summary['request_rate']} QPS {summary['arrival']} (burstiness {summary['burstiness']}){cap}"


def section7_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(record, value) for every DESIGN §7 row the run can fill."""
    lens = s["input_len_stats"]
    slo = s["slo"]
    positions = ", ".join(f"{rate:.2f}" for rate in s["acceptance_by_position"]) or "–"
    queues = " / ".join(_f(s[f"{worker}_queue_ms_p{q}"]) for worker in ("verifier", "drafter") for q in (50, 99))
    return [
        ("load", _load(s)),
        ("requests (measured / warm-up)", f"{s['num_prompts']} / {s['warmup_requests']}"),
        (
            "input tokens min / median / p95 / max",
            " / ".join(_f(lens[k], ".0f") for k in ("min", "median", "p95", "max")),
        ),
        ("prompt categories", ", ".join(f"{k} {v}" for k, v in s["category_counts"].items())),
        ("tokens committed per round", _f(s["tokens_per_round"])),
        ("drafted tokens (drafts)", f"{s['draft_tokens']} ({_f(s['num_drafts'], 'd')})"),
        ("acceptance rate (accepted / drafted)", _f(s["acceptance_rate"], ".3f")),
        ("mean accepted length (1 + accepted / rounds)", _f(s["mean_accepted_length"])),
        ("acceptance by position (per round)", positions),
        ("draft ms / round", _f(s["draft_ms_per_round"])),
        ("verify ms / round", _f(s["verify_ms_per_round"])),
        ("state-refresh ms / round", _f(s["state_ms_per_round"])),
        ("wall ms / round (other)", f"{_f(s['wall_ms_per_round'])} ({_f(s['other_ms_per_round'])})"),
        ("router overhead ms p50 / p99", f"{_f(s['router_overhead_ms_p50'])} / {_f(s['router_overhead_ms_p99'])}"),
        ("of which verifier queue, drafter queue ms p50 / p99", queues),
        ("pipeline hit rate", _f(s["pipeline_hit_rate"])),
        ("wire bytes / round", _f(s["wire_bytes_per_round"], ".0f")),
        ("drafter fallbacks", str(s["drafter_fallbacks"])),
        ("TTFT ms median / p95", f"{_f(s['median_ttft_ms'], '.1f')} / {_f(s['p95_ttft_ms'], '.1f')}"),
        ("ITL ms median / p95", f"{_f(s['median_itl_ms'], '.1f')} / {_f(s['p95_itl_ms'], '.1f')}"),
        ("TPOT ms median / p95", f"{_f(s['median_tpot_ms'], '.1f')} / {_f(s['p95_tpot_ms'], '.1f')}"),
        ("e2e latency ms median / p95", f"{_f(s['median_e2el_ms'], '.1f')} / {_f(s['p95_e2el_ms'], '.1f')}"),
        ("output tokens/s", _f(s["output_throughput"], ".1f")),
        ("completed requests/s", _f(s["request_throughput"], ".3f")),
        ("goodput requests/s" + (f" ({slo_text(slo)})" if slo else ""), _f(s["request_goodput"], ".3f")),
        ("errors (timeouts)", f"{s['failed']} ({s['timeouts']})" + _kinds(s["errors_by_kind"])),
        ("completion rate", _f(s["completion_rate"], ".3f")),
    ]


def slo_text(slo: dict[str, float | None]) -> str:
    """``TTFT ≤ 250 ms, p95 ITL ≤ 600 ms``: the bounds that are set."""
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "p95 ITL"}
    return ", ".join(f"{names[key]} ≤ {value:g} ms" for key, value in slo.items() if value is not None)


def _kinds(kinds: dict[str, int]) -> str:
    return ": " + ", ".join(f"{k} {v}" for k, v in kinds.items()) if kinds else ""


def point_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [*_header(meta), f"## {summary['label'] or 'run'}", "", "| record | value |", "|---|---|"]
    lines += [f"| {record} | {value} |" for record, value in section7_rows(summary)]
    if summary["metrics_error"]:
        lines += ["", f"Router metrics not scraped: {summary['metrics_error']}"]
    return "\n".join(lines) + "\n"


_SWEEP_COLUMNS = (
    ("QPS / conc.", lambda s: _f(s["request_rate"] if s["concurrency"] is None else f"c{s['concurrency']}", "g")),
    ("speculation", lambda s: mode_name(s["speculation"])),
    ("done / failed (timeouts)", lambda s: f"{s['completed']} / {s['failed']} ({s['timeouts']})"),
    ("req/s", lambda s: _f(s["request_throughput"], ".3f")),
    ("out tok/s", lambda s: _f(s["output_throughput"], ".1f")),
    ("TTFT ms p50 / p95", lambda s: f"{_f(s['median_ttft_ms'], '.0f')} / {_f(s['p95_ttft_ms'], '.0f')}"),
    ("ITL ms p50 / p95", lambda s: f"{_f(s['median_itl_ms'], '.1f')} / {_f(s['p95_itl_ms'], '.1f')}"),
    ("e2e ms p50 / p95", lambda s: f"{_f(s['median_e2el_ms'], '.0f')} / {_f(s['p95_e2el_ms'], '.0f')}"),
    ("tokens / round", lambda s: _f(s["tokens_per_round"])),
    ("acc. rate", lambda s: _f(s["acceptance_rate"], ".3f")),
    ("mean acc. len", lambda s: _f(s["mean_accepted_length"])),
    ("draft / verify / state ms/round", lambda s: "/".join(_f(s[f"{k}_ms_per_round"], ".1f") for k in _PARTS)),
    ("goodput req/s", lambda s: _f(s["request_goodput"], ".3f")),
    ("saturated", lambda s: "yes" if s.get("saturation") else ""),
)
_PARTS = ("draft", "verify", "state")


def sweep_markdown(document: dict[str, Any]) -> str:
    lines = [*_header(document), "| " + " | ".join(h for h, _ in _SWEEP_COLUMNS) + " |"]
    lines.append("|" + "---|" * len(_SWEEP_COLUMNS))
    lines += ["| " + " | ".join(cell(s) for _, cell in _SWEEP_COLUMNS) + " |" for s in document["points"]]
    lines += ["", f"Saturation rule: {document['saturation_rule']}."]
    lines += [f"- {mode} stopped {why}" for mode, why in document["stopped"].items()]
    if document["slo"]:
        bounds = ", ".join(
            f"p95 {name} ≤ {document['slo'][key]:g} ms"
            for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"))
            if document["slo"][key] is not None
        )
        lines += ["", f"Target QPS (highest swept QPS with no failed request and {bounds}):"]
        lines += [f"- {mode}: {_f(qps, 'g')}" for mode, qps in document["target_qps"].items()]
    return "\n".join(lines) + "\n"


# --- all files ------------------------------------------------------------------------------------------------


def compact_json(document: Any) -> str:
    """``document`` as one line of JSON with floats rounded to 1e-6 (a microsecond, for the times in seconds).

    A run keeps every request's chunk times: at 2000 requests, pretty-printed full-precision floats made a 8 MB
    file, most of it whitespace and digits below the clock's resolution.
    """

    def rounded(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, 6)
        if isinstance(value, dict):
            return {key: rounded(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [rounded(item) for item in value]
        return value

    return json.dumps(rounded(document), separators=(",", ":")) + "\n"


def point_stem(name: str, point: Point) -> str:
    """File stem of one point of sweep ``name``."""
    return f"{name}-{point[1]['label']}"


def write_point(result_dir: Path, stem: str, point: Point, meta: dict[str, Any]) -> list[Path]:
    """Write one point's JSON and Markdown. Sweeps call it as each point finishes, so a sweep that is killed
    (a time limit, a lost machine) keeps the points it finished."""
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = [result_dir / f"{stem}.json", result_dir / f"{stem}.md"]
    paths[0].write_text(compact_json(point_document(point, meta)))
    paths[1].write_text(point_markdown(point[1], meta))
    return paths


def write_report(result_dir: Path, name: str, document: Any, markdown_text: str) -> None:
    """``NAME.json`` (``document``) and ``NAME.md`` (``markdown_text``) into ``result_dir``; prints the Markdown."""
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    (result_dir / f"{name}.md").write_text(markdown_text)
    print(markdown_text)


def write_results(
    result_dir: Path,
    name: str,
    points: Sequence[Point],
    meta: dict[str, Any],
    *,
    slo: Slo | None = None,
    stopped: dict[str, str] | None = None,
    plots: bool = True,
) -> tuple[str, list[Path]]:
    """Write every file; returns the Markdown to print (the sweep table, or the single point's) and the paths."""
    result_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def write(filename: str, text: str) -> None:
        path = result_dir / filename
        path.write_text(text)
        written.append(path)

    single = len(points) == 1
    for point in points:
        written += write_point(result_dir, name if single else point_stem(name, point), point, meta)
    if single:
        markdown = point_markdown(points[0][1], meta)
    else:
        document = sweep_document(points, meta, slo, stopped or {})
        markdown = sweep_markdown(document)
        write(f"{name}-sweep.json", json.dumps(document, indent=1) + "\n")
        write(f"{name}-sweep.md", markdown)
    if plots:
        written.append(plot_latency_cdfs(points, result_dir / f"{name}-latency-cdf.png"))
        written.append(plot_acceptance(points, result_dir / f"{name}-acceptance.png"))
        written.append(plot_round_split(points, result_dir / f"{name}-round-split.png"))
        if len({s["request_rate"] for _, s in points}) > 1:
            written.append(
                plot_sweep(points, "output_throughput", "output tokens/s", result_dir / f"{name}-sweep-throughput.png")
            )
            written.append(plot_sweep(points, "p95_itl_ms", "p95 ITL ms", result_dir / f"{name}-sweep-p95-itl.png"))
    return markdown, written
