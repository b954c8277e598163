#!/usr/bin/env bash
# Generates the Python stubs (messages, gRPC, mypy stubs) for one package prefix.
# Usage: protos/generate.sh OUT_DIR PYTHON_PACKAGE_PREFIX
#   protos/generate.sh service/_gen service._gen
# protoc writes absolute imports (`from retrieval.v1 import ...`); they are rewritten to
# live under the given package so the stubs need no sys.path tricks.
set -euo pipefail
out=$1
prefix=$2
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
rm -rf "$out"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I"$here" \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  "$here"/retrieval/v1/*.proto 2> >(grep -v "^Writing mypy" >&2)
# Only the files that define services keep their *_grpc modules.
for f in "$out"/retrieval/v1/{types,plan}_pb2_grpc.py "$out"/retrieval/v1/{types,plan}_pb2_grpc.pyi; do rm -f "$f"; done
find "$out" -name '*.py' -o -name '*.pyi' | while read -r f; do
  sed -i "s/^from retrieval\.v1 import /from ${prefix}.retrieval.v1 import /" "$f"
done
for d in "$out" "$out/retrieval" "$out/retrieval/v1"; do
  printf '"""Generated from protos/retrieval/v1 by protos/generate.sh; do not edit."""\n' >"$d/__init__.py"
done
