"""``make demo``: it reads what ``specdec up`` prints (a regression test for the demo breaking when ``up`` began
reporting a list of routers instead of one router), and a cached head it cannot serve stops it with the reason
before anything starts (before: ``specdec up`` failed when the eagle drafter did)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.demo import ensure_head, first_router
from launcher.cluster import ClusterState


def test_the_demo_reads_the_router_that_up_reports() -> None:
    router = {"grpc": "127.0.0.1:5001", "http": "127.0.0.1:5002"}
    state = ClusterState(supervisor_pid=1, status="ready", routers=[router], workers=[])
    assert first_router(json.loads(json.dumps(state.addresses()))) == router


def test_a_cached_head_of_an_older_layout_stops_the_demo_with_the_reason(tmp_path: Path) -> None:
    config = {  # what specdec wrote for fused heads before they took EAGLE-3's layout
        "speculators_model_type": "eagle3",
        "feature": "rms_normalised_layer_outputs",
        "transformer_layer_config": {"hidden_size": 576},
        "draft_vocab_size": 8192,
        "eagle_aux_hidden_state_layer_ids": [1, 14, 26],
        "speculators_config": {"verifier": {"name_or_path": "smollm2-135m"}},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"cannot be served \(draft_model: .*\)\. Move .* aside") as stop:
        ensure_head(tmp_path)
    assert "older than specdec's EAGLE-3 layout" in str(stop.value)
    assert "specdec distill --target smollm2-135m" in str(stop.value)
