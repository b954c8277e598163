#!/usr/bin/env bash
# The pytest step of `make test`: every tier, against a real OpenSearch node.
#
# When OPENSEARCH_URL is unset and Java + Maven are on the machine, a single node is
# started from Maven artifacts (deploy/opensearch/opensearch.sh) on a test port and
# stopped afterwards. Without them the OpenSearch tests skip with a loud reason, except
# under CI=true, where they fail (tests/support/opensearch.py).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
OS_SCRIPT=deploy/opensearch/opensearch.sh
OS_PORT=${OPENSEARCH_TEST_PORT:-9250}
OS_DATA=$(mktemp -d -t retrieval-os-XXXXXX)
chmod 777 "$OS_DATA"   # the node runs as an unprivileged user when we are root
started=""

cleanup() {
  if [[ -n "$started" ]]; then
    "$OS_SCRIPT" stop --port "$OS_PORT" --data-dir "$OS_DATA" >/dev/null 2>&1 || true
  fi
  rm -rf "$OS_DATA"
}
trap cleanup EXIT

have() { command -v "$1" >/dev/null 2>&1; }

if have mvn && have java; then
  # Lucene jars for the analyzer/BM25 oracle tests (cached in ~/.m2 after the first run).
  for a in lucene-core lucene-analysis-common; do
    mvn -q dependency:get -Dartifact="org.apache.lucene:$a:9.12.3" >/dev/null 2>&1 ||
      echo "warning: could not fetch org.apache.lucene:$a:9.12.3; the Lucene oracle tests will skip" >&2
  done
fi

if [[ -z "${OPENSEARCH_URL:-}" ]]; then
  if have mvn && have java; then
    echo "== starting a local OpenSearch node on 127.0.0.1:$OS_PORT (Maven artifacts, cached in ~/.m2)"
    "$OS_SCRIPT" start --port "$OS_PORT" --data-dir "$OS_DATA"
    started=1
    export OPENSEARCH_URL="http://127.0.0.1:$OS_PORT"
  else
    echo "!!! Java or Maven missing: the OpenSearch tests will SKIP (and FAIL under CI=true)." >&2
  fi
fi

"$PY" -m pytest "$@"
