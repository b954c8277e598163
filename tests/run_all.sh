#!/usr/bin/env bash
# The pytest step of `make test`: every tier, against a real OpenSearch node.
#
# When OPENSEARCH_URL is unset, a single node is started from Maven artifacts
# (deploy/opensearch/opensearch.sh; needs Maven and a JDK >= 21) on a test port and stopped
# afterwards; a node already running there is used and left alone. Without one the
# OpenSearch tests skip with a loud reason, except under CI=true, where they fail
# (tests/support/opensearch.py). The fault suite starts its own node on port 9290.
set -uo pipefail
cd "$(dirname "$0")/.."

OS=deploy/opensearch/opensearch.sh
PORT="${OPENSEARCH_TEST_PORT:-9250}"
started=""
have() { command -v "$1" >/dev/null 2>&1; }

if have mvn && have java; then
  # Lucene jars for the analyzer/BM25 oracle tests (cached in ~/.m2 after the first run).
  for a in lucene-core lucene-analysis-common; do
    mvn -q dependency:get -Dartifact="org.apache.lucene:$a:9.12.3" >/dev/null 2>&1 ||
      echo "warning: could not fetch org.apache.lucene:$a:9.12.3; the Lucene oracle tests will skip" >&2
  done
fi

if [[ -z "${OPENSEARCH_URL:-}" ]]; then
  if ! "$OS" status --port "$PORT" >/dev/null 2>&1; then
    echo "== starting a local OpenSearch node on 127.0.0.1:$PORT (Maven artifacts, cached in ~/.m2)"
    if "$OS" start --port "$PORT"; then
      started=1
    else
      echo "!!! no OpenSearch (needs mvn + a JDK >= 21): its tests skip, or fail under CI=true" >&2
    fi
  fi
  "$OS" status --port "$PORT" >/dev/null 2>&1 && export OPENSEARCH_URL="http://127.0.0.1:$PORT"
fi
trap '[[ -n "$started" ]] && "$OS" stop --port "$PORT"' EXIT

# --durations: the slowest tests in every log, so a creeping one is seen before it hits the timeout.
.venv/bin/python -m pytest --durations=15 "$@"
