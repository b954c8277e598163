"""The commands a newcomer types, run as real processes: serve, ingest, query."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_serve_ingest_query_from_the_command_line(tmp_path: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--listen", target,
                             "--data-dir", str(tmp_path / "data"), "--demo"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
        while "Demo corpus loaded" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        out = (tmp_path / "serve.log").read_text()
        assert f"serving retrieval.v1 on {target}" in out and "query --target" in out

        docs = tmp_path / "docs.jsonl"
        docs.write_text(
            json.dumps({"source_id": "cli-doc", "version": "v1", "title": "Kayak rental",
                        "text": "Kayaks can be rented at the north pier for 20 euros per hour.",
                        "collection": "doc"}) + "\n"
            + json.dumps({"source_id": "bad doc", "version": "v1", "text": "x", "collection": "doc"}) + "\n"
            + "not json\n")
        ing = run("ingest", "--target", target, str(docs))
        assert ing.returncode == 1, ing  # one bad document and one bad line are reported
        assert "indexed 1" in ing.stdout and "document.source_id" in ing.stdout
        assert "skipped" in ing.stderr

        q = run("query", "--target", target, "where can I rent a kayak", "--json", "--top-k", "2")
        assert q.returncode == 0, q.stderr
        events = [json.loads(line) for line in q.stdout.splitlines()]
        assert events[-1]["result"]["outcome"] == "ATTEMPT_OUTCOME_EVIDENCE_FOUND"
        assert next(e for e in events if "evidence" in e)["evidence"]["source_id"] == "cli-doc"
        # The default serves the Latin-script leg wherever its model is built (make test builds it).
        from service.app import DEFAULT_LATIN_EMBEDDER
        from service.offline.builder import default_models_dir

        if (default_models_dir() / DEFAULT_LATIN_EMBEDDER / "model.onnx").exists() or os.environ.get("CI") == "true":
            legs = {leg["kind"]: leg["status"] for leg in events[-1]["result"]["legs"]}
            assert legs["LEG_KIND_KNN_LATIN"] == "LEG_STATUS_OK", legs

        readable = run("query", "--target", target, "如何开具发票")
        assert "faq-invoice-zh" in readable.stdout and "outcome EVIDENCE_FOUND" in readable.stdout

        lookup = run("query", "--target", target, "what is new in v2.4", "--lookup")
        assert json.loads(lookup.stdout)["evidence"][0]["document_id"].endswith("@v2.4")

        bad = run("query", "--target", target, "x", "--top-k", "0")
        assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "top_k" in bad.stderr
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, "graceful shutdown on SIGTERM"
        log.close()
