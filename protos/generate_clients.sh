#!/usr/bin/env bash
# Generates the Go or TypeScript client stubs from every .proto in protos/retrieval/v1.
# Usage: [PROTOS_DIR=protos] protos/generate_clients.sh go|ts OUT_DIR
#   protos/generate_clients.sh go clients/go/gen
#   protos/generate_clients.sh ts clients/ts/src/gen
# The same protoc as the Python stubs (grpcio-tools from the venv: PYTHON) runs local,
# pinned plugins: protoc-gen-go / protoc-gen-go-grpc built into GO_PLUGINS (Makefile
# `tools`), ts-proto from clients/ts/node_modules (its package-lock.json pins it).
set -euo pipefail
lang=$1
out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
here=${PROTOS_DIR:-$root/protos}  # another protos/ tree (the drift test's altered copy)
python=${PYTHON:-python}
protos=("$here"/retrieval/v1/*.proto)
rel=("${protos[@]#"$here"/}")
rm -rf "$out"
mkdir -p "$out"
case $lang in
  go)
    plugins=${GO_PLUGINS:-$root/.cache/tools/bin}
    module=$(sed -n 's/^module //p' "$root/clients/go/go.mod")
    # The protos carry no go_package (they are shared by every language), so each file is
    # mapped to one Go package here; a new .proto in retrieval/v1 is picked up as it is.
    maps=()
    for f in "${rel[@]}"; do maps+=("M$f=$module/gen/retrieval/v1;retrievalv1"); done
    go_opts=$(IFS=,; echo "paths=source_relative,${maps[*]}")
    "$python" -m grpc_tools.protoc -I"$here" \
      --plugin=protoc-gen-go="$plugins/protoc-gen-go" --go_out="$out" --go_opt="$go_opts" \
      --plugin=protoc-gen-go-grpc="$plugins/protoc-gen-go-grpc" --go-grpc_out="$out" --go-grpc_opt="$go_opts" \
      "${protos[@]}"
    ;;
  ts)
    plugin=$root/clients/ts/node_modules/.bin/protoc-gen-ts_proto
    [[ -x $plugin ]] || { echo "missing $plugin: run 'npm ci' in clients/ts (make ts-deps)" >&2; exit 1; }
    # google.rpc.Status / BadRequest / RetryInfo decode the error details the server sends;
    # their .proto files ship with googleapis-common-protos in the same venv.
    site=$("$python" -c 'import google.rpc, os; print(os.path.dirname(os.path.dirname(google.rpc.__path__[0])))')
    "$python" -m grpc_tools.protoc -I"$here" -I"$site" \
      --plugin=protoc-gen-ts_proto="$plugin" --ts_proto_out="$out" \
      --ts_proto_opt=outputServices=grpc-js,env=node,esModuleInterop=true,oneof=unions-value,useDate=false \
      "${protos[@]}" "$site/google/rpc/status.proto" "$site/google/rpc/error_details.proto"
    ;;
  *)
    echo "usage: $0 go|ts OUT_DIR" >&2
    exit 2
    ;;
esac
