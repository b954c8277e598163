"""``python -m service.offline.builder build [--out DIR] [--force]``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from service.offline.builder import build_all, default_models_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.offline.builder")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the ONNX models from installed weight packages")
    build.add_argument("--out", type=Path, default=None, help=f"output dir (default: {default_models_dir()})")
    build.add_argument("--force", action="store_true", help="rebuild even if the manifests are current")
    build.add_argument("--no-bge", dest="bge", action="store_false",
                       help="skip the carded bge-small embedders (built from their Maven jars by default)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    for path in build_all(args.out, force=args.force, bge=args.bge):
        print(path)
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
