"""The README's Python example runs as written against a live server."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import Live

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


async def test_readme_python_example_runs(demo: Live, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.lstrip().startswith("# "), "title first"
    first_block = re.search(r"```\n(.*?)```", readme, re.S)
    assert first_block and first_block.group(1).split("\n")[0].startswith("make run")
    assert first_block.group(1).split("\n")[1].startswith("make test")
    code = re.search(r"```python\n(.*?)```", readme, re.S)
    assert code is not None
    script = tmp_path / "example.py"
    script.write_text(code.group(1).replace("127.0.0.1:50051", demo.target))
    # The server lives on this event loop, so the example runs as an async subprocess.
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), cwd=ROOT,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    assert b"kb-password-reset" in stdout and b"ATTEMPT_OUTCOME_EVIDENCE_FOUND" in stdout
