"""Generate the Python protobuf and gRPC stubs into ``gen/specdec_wire`` (git-ignored), never committed.

The wire package stays ``specdec.v1`` (service paths like ``/specdec.v1.Verifier/Verify``), but the
Python modules are named ``specdec_wire.v1.*`` so the core library ``specdec`` holds no gRPC code:
protoc writes ``specdec/v1/*_pb2*.py`` and this script rewrites their imports while moving them.
A ``.pth`` file puts ``gen/`` on the interpreter's path. Run by ``make install``; safe to rerun.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "gen"
PACKAGE = "specdec_wire"
IMPORT = re.compile(r"^from specdec\.v1 import", flags=re.MULTILINE)


def main() -> int:
    sources = sorted(str(path.relative_to(PROTOS)) for path in (PROTOS / "specdec" / "v1").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    target = OUT / PACKAGE / "v1"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTOS}",
                f"-I{include}",
                f"--python_out={scratch}",
                f"--pyi_out={scratch}",
                f"--grpc_python_out={scratch}",
                *sources,
            ]
        )
        if status != 0:
            return status
        for generated in (Path(scratch) / "specdec" / "v1").iterdir():
            text = IMPORT.sub(f"from {PACKAGE}.v1 import", generated.read_text())
            (target / generated.name).write_text(text)
    for package in (OUT / PACKAGE, target):
        (package / "__init__.py").touch()
    site_packages = Path(sysconfig.get_paths()["purelib"])
    (site_packages / "specdec_generated.pth").write_text(f"{OUT}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
