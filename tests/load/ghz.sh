#!/usr/bin/env bash
# ghz scenarios for your own load tests: Retrieve (server stream) and Lookup (unary) against
# a running server, through server reflection (no proto files needed).
#
#   tests/load/ghz.sh [TARGET]        default 127.0.0.1:50051 (the server `make run` starts)
#
# Env: GHZ_CONCURRENCY (levels, default "1 8 32"), GHZ_REQUESTS (per level, default 400),
#      GHZ_ARGS (extra ghz flags, e.g. "--metadata={\"x-api-key\":\"...\"}" or TLS flags),
#      GHZ_FORMAT (ghz --format, default summary; csv/json/html for reports).
# ghz is installed once with `go install` (pinned below) into .cache/tools/.
# Each query carries the request number, so the query-embedding cache never answers it and
# every request pays the real model work (drop "{{.RequestNumber}}" to measure cache hits).
set -euo pipefail
cd "$(dirname "$0")/../.."

GHZ_VERSION=v0.120.0
GHZ_DIR="$(pwd)/.cache/tools/ghz-$GHZ_VERSION"
GHZ="$GHZ_DIR/ghz"
if [[ ! -x "$GHZ" ]]; then
  command -v go >/dev/null || { echo "ghz.sh: needs Go to install ghz $GHZ_VERSION" >&2; exit 2; }
  echo "ghz.sh: installing ghz $GHZ_VERSION (go install, once)" >&2
  GOBIN="$GHZ_DIR" go install "github.com/bojand/ghz/cmd/ghz@$GHZ_VERSION"
fi

TARGET="${1:-127.0.0.1:50051}"
LEVELS="${GHZ_CONCURRENCY:-1 8 32}"
TOTAL="${GHZ_REQUESTS:-400}"
FORMAT="${GHZ_FORMAT:-summary}"
read -r -a EXTRA <<<"${GHZ_ARGS:-}"

# name | method | request (JSON; ghz templates allowed)
SCENARIOS=(
  "lookup-en|retrieval.v1.RetrievalService/Lookup|{\"query\": \"how do I reset my password {{.RequestNumber}}\", \"top_k\": 3}"
  "lookup-zh|retrieval.v1.RetrievalService/Lookup|{\"query\": \"如何开具发票 {{.RequestNumber}}\", \"top_k\": 3}"
  "retrieve-en|retrieval.v1.RetrievalService/Retrieve|{\"query\": \"what changed in v2.4 {{.RequestNumber}}\", \"top_k\": 5}"
  "retrieve-hybrid-no-rerank|retrieval.v1.RetrievalService/Retrieve|{\"query\": \"refund policy for annual plans {{.RequestNumber}}\", \"top_k\": 5, \"options\": {\"rerank\": \"RERANK_MODE_OFF\"}}"
)

for s in "${SCENARIOS[@]}"; do
  IFS='|' read -r name method data <<<"$s"
  for c in $LEVELS; do
    n=$(( TOTAL > c ? TOTAL : c ))
    echo "== $name  concurrency $c  requests $n  ($method)"
    "$GHZ" --insecure --call "$method" -d "$data" -c "$c" -n "$n" --format "$FORMAT" "${EXTRA[@]}" "$TARGET"
  done
done
