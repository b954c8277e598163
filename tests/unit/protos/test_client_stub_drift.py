"""The Go and TypeScript stubs are what protos/ generates (the drift check of `make
proto-check`), every .proto in protos/retrieval/v1 is picked up without a list to edit,
and a proto change that is not regenerated is caught for each language."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "protos" / "generate_clients.sh"
CHECKED_IN = {"go": ROOT / "clients" / "go" / "gen", "ts": ROOT / "clients" / "ts" / "src" / "gen"}


def _plugins() -> Path:
    found = sorted((ROOT / ".cache" / "tools").glob("go-plugins-*/protoc-gen-go-grpc"))
    ts = ROOT / "clients" / "ts" / "node_modules" / ".bin" / "protoc-gen-ts_proto"
    if not found or not ts.exists():
        message = "the protoc plugins are not installed: run `make tools ts-deps` (make test does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found[-1].parent


def _generate(lang: str, out: Path, protos: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GO_PLUGINS": str(_plugins()), "PROTOS_DIR": str(protos)}
    subprocess.run(["bash", str(SCRIPT), lang, str(out)], check=True, env=env, capture_output=True, timeout=120)


def _differences(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b)
    out = [*cmp.left_only, *cmp.right_only, *cmp.diff_files, *cmp.funny_files]
    for name, sub in cmp.subdirs.items():
        out += [f"{name}/{d}" for d in _differences(Path(sub.left), Path(sub.right))]
    return out


@pytest.mark.parametrize("lang", ["go", "ts"])
def test_checked_in_stubs_match_the_protos_and_a_change_is_caught(lang: str, tmp_path: Path) -> None:
    _generate(lang, tmp_path / "now", ROOT / "protos")
    assert _differences(tmp_path / "now", CHECKED_IN[lang]) == [], "run `make proto` and commit"

    altered = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", altered)
    proto = altered / "retrieval" / "v1" / "retrieval.proto"
    text = proto.read_text()
    proto.write_text(text.replace("message RetrieveRequest {\n", "message RetrieveRequest {\n  string drift_probe = 99;\n", 1))
    (altered / "retrieval" / "v1" / "probe.proto").write_text(
        'syntax = "proto3";\n\npackage retrieval.v1;\n\nimport "retrieval/v1/types.proto";\n\n'
        "message Probe {\n  AttemptOutcome outcome = 1;\n}\n")
    _generate(lang, tmp_path / "altered", altered)
    changed = _differences(tmp_path / "altered", CHECKED_IN[lang])
    stem = {"go": ("retrieval/v1/retrieval.pb.go", "retrieval/v1/probe.pb.go"),
            "ts": ("retrieval/v1/retrieval.ts", "retrieval/v1/probe.ts")}[lang]
    assert set(stem) <= set(changed), changed
