"""Extract a CRD's ``openAPIV3Schema`` into the compact JSON the Kubernetes tests validate against.

    python tests/data/k8s-schemas/vendor.py CRD.yaml VERSION OUT.json

See README.md here for where each file came from. Run by hand when a CRD is updated; the tests read only the
JSON, so they need neither the network nor the upstream repositories.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def openapi_schema(crd_path: Path, version: str) -> dict:
    crd = yaml.safe_load(crd_path.read_text())
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return served["schema"]["openAPIV3Schema"]
    raise SystemExit(f"{crd_path}: no version {version}")


if __name__ == "__main__":
    source, version, out = sys.argv[1:]
    schema = openapi_schema(Path(source), version)
    Path(out).write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")
