"""The command line's own behaviour (the commands themselves are tested end to end)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`service query ... | head`: the pipe closes under a command still printing; it stops
    with SIGPIPE's status and no traceback."""
    code = ("import service.cli as cli\n"
            "def loud(args):\n"
            "    for _ in range(100_000):\n"
            "        print('evidence ' * 20)\n"
            "    return 0\n"
            "cli.cmd_demo_corpus = loud\n"
            "raise SystemExit(cli.main(['demo-corpus']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(100).startswith(b"evidence")
    proc.stdout.close()  # what `head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
