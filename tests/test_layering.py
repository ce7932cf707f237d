"""Layering (DESIGN §2, §10): the core library :mod:`specdec` imports nothing from the packages built on it, and
no gRPC except in the client SDK; the ``specdec`` command still offers the subcommands of those packages, which
plug in as ``specdec.commands`` entry points instead of being imported by the core."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specdec.cli import main

SPECDEC = Path(__file__).resolve().parents[1] / "specdec"
ABOVE_THE_CORE = {"bench", "launcher", "router", "drafter_service", "verifier_service", "grpc_common"}
WIRE = {"grpc", "specdec_wire"}
# The SDK is the one module that talks to a router; it needs gRPC and the generated stubs, nothing more.
ALLOWED = {Path("client.py"): WIRE}


def top_level_imports(path: Path) -> set[str]:
    """First component of every absolute import in the module, wherever it is (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


MODULES = sorted(SPECDEC.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(SPECDEC)))
def test_core_module_imports_nothing_above_the_core(path: Path) -> None:
    relative = path.relative_to(SPECDEC)
    forbidden = (ABOVE_THE_CORE | WIRE) - ALLOWED.get(relative, set())
    assert not top_level_imports(path) & forbidden


def test_the_sdk_imports_exactly_its_allowance() -> None:
    """If the SDK stops needing gRPC, or the file moves, the allowance above must go too."""
    for relative, allowed in ALLOWED.items():
        assert top_level_imports(SPECDEC / relative) & (ABOVE_THE_CORE | WIRE) == allowed


def test_help_lists_the_core_and_the_plugged_in_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert "{generate,distill,check,bench,up,status,down}" in usage, usage


@pytest.mark.parametrize("command", ["bench", "up", "status", "down"])
def test_plugged_in_subcommand_parses(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: specdec {command}")


def test_plugged_in_subcommand_runs_through_main(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``main`` dispatches to the plugin's run function and maps its error to the one-line exit status 2."""
    monkeypatch.setenv("SPECDEC_STATE_FILE", str(tmp_path / "none.json"))
    assert main(["status"]) == 2
    assert capsys.readouterr().err.startswith("specdec: error: no deployment recorded in ")
