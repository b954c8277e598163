"""The Go client's own tests (clients/go, `go test`) and the README's Go example, against
the live server this package's conftest starts."""

from __future__ import annotations

import re

import pytest

from tests.support.clients import GO_CLIENT, ROOT, ClientServer, need, run

pytestmark = pytest.mark.slow


async def test_go_client_suite(client_server: ClientServer) -> None:
    ran = await run(need("go"), "test", "-count=1", "-v", "./...", cwd=GO_CLIENT, env=client_server.env())
    ran.check("go test")
    print(ran.stdout)
    assert "ok  \tretrieval.internal/clients/go\t" in ran.stdout, ran.stdout
    assert "--- SKIP" not in ran.stdout and ran.stdout.count("--- PASS") >= 9, ran.stdout


async def test_readme_go_example_is_the_example_and_runs(client_server: ClientServer) -> None:
    example = GO_CLIENT / "examples" / "quickstart" / "main.go"
    block = re.search(r"```go\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "README has a Go example"
    assert block.group(1) == example.read_text(), "the README's Go example is clients/go/examples/quickstart/main.go"
    ran = (await run(need("go"), "run", "./examples/quickstart", cwd=GO_CLIENT, env=client_server.env())).check("go run")
    assert "1 kb-password-reset#0@v1" in ran.stdout and "outcome: EVIDENCE_FOUND" in ran.stdout, ran.stdout
    assert '"evidence_status":"EVIDENCE_FOUND"' in ran.stdout, ran.stdout
