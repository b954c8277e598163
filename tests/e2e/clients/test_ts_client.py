"""The TypeScript client's own tests (clients/ts, `node --test` on the tsc --strict
build) and the README's TypeScript example, against the live server this package's
conftest starts."""

from __future__ import annotations

import re

import pytest

from tests.support.clients import ROOT, TS_CLIENT, ClientServer, need, run, ts_built

pytestmark = pytest.mark.slow


async def test_typescript_client_suite(client_server: ClientServer) -> None:
    dist = await ts_built()
    ran = await run(need("node"), "--test", str(dist / "test" / "client.test.js"), cwd=TS_CLIENT,
                    env=client_server.env())
    print(ran.stdout)
    ran.check("node --test")
    assert re.search(r"^# pass (\d+)$", ran.stdout, re.M) and "# fail 0" in ran.stdout, ran.stdout
    assert int(re.search(r"^# pass (\d+)$", ran.stdout, re.M).group(1)) >= 10, ran.stdout  # type: ignore[union-attr]
    assert "# skipped 0" in ran.stdout, ran.stdout


async def test_readme_typescript_example_is_the_example_and_runs(client_server: ClientServer) -> None:
    example = TS_CLIENT / "examples" / "quickstart.ts"
    block = re.search(r"```ts\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "README has a TypeScript example"
    assert block.group(1) == example.read_text(), "the README's TypeScript example is clients/ts/examples/quickstart.ts"
    dist = await ts_built()
    ran = (await run(need("node"), str(dist / "examples" / "quickstart.js"), cwd=TS_CLIENT,
                     env=client_server.env())).check("node examples/quickstart.js")
    assert "1 kb-password-reset#0@v1" in ran.stdout and "outcome: EVIDENCE_FOUND" in ran.stdout, ran.stdout
    assert '"evidence_status":"EVIDENCE_FOUND"' in ran.stdout, ran.stdout
