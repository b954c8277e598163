"""deploy/opensearch/opensearch.sh after its nodes died with the session that started them.

A session (or a CI run) that is killed leaves the JVM's own pid file behind and, when only the
starter died, a JVM nobody's pid file names. Seen in CI: the next `start` read the stale pid
as its new node's, judged the node dead at once ("no healthy cluster"), and left the new JVM
holding the port for every later start ("in use by something that is not ours").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.service_live import SCRIPT, ScriptNodes

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

PORT = int(os.environ.get("OPENSEARCH_LAUNCHER_TEST_PORT", "9285"))


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True
        time.sleep(0.2)
    return False


def test_start_recovers_from_killed_nodes_and_stop_finds_strays() -> None:
    nodes = ScriptNodes(port=PORT, nodes=1, heap="512m").start()
    assert nodes.run_dir is not None  # where the launcher keeps this port's pid files
    state = nodes.run_dir
    try:
        first = nodes.pids[0]
        os.kill(first, signal.SIGKILL)  # the node dies with its session: no cleanup runs
        assert _gone(first)
        assert (state / "node-0" / "opensearch.pid").exists()  # what a killed JVM leaves behind

        nodes.start()  # the stale pid file must not be read as the new node's
        second = nodes.pids[0]
        assert second != first and nodes.health()["status"] in {"green", "yellow"}

        for stale in (state / "node-0.pid", state / "node-0" / "opensearch.pid"):
            stale.unlink()  # the starter died before it kept the pid: a stray JVM of ours
        nodes.stop()
        assert _gone(second), "stop left a JVM of ours running without a pid file"
        nodes.start()  # and the port is free again
        assert nodes.pids[0] not in {first, second}
    finally:
        nodes.stop()


def _listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_port_held_by_a_stranger_is_refused_and_one_freed_in_time_is_taken() -> None:
    """A JVM killed a moment ago holds its ports until its last thread exits (CI saw a start
    right after a SIGKILL refused with "in use by something that is not ours"): start waits
    OPENSEARCH_PORT_WAIT_S for a busy port, and only then calls it foreign."""
    port = PORT + 1  # no node of the test above lives there (single node: PORT, PORT + 100)
    nodes = ScriptNodes(port=port, nodes=1, heap="512m")
    stranger = _listener(port)
    try:
        started = time.monotonic()
        proc = subprocess.run([str(SCRIPT), "start", "--port", str(port), "--nodes", "1"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OPENSEARCH_PORT_WAIT_S": "2"})
        assert proc.returncode != 0 and "is in use by something that is not ours" in proc.stderr, proc.stderr
        assert time.monotonic() - started >= 2.0  # it waited before it gave up
        threading.Timer(3.0, stranger.close).start()  # freed while start waits (default 30 s)
        nodes.start()
        assert nodes.health()["status"] in {"green", "yellow"}
    finally:
        stranger.close()
        nodes.stop()
