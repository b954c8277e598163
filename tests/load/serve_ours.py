"""Our server for `make bench`: ``python -m service serve`` as it ships, except that passage
embeddings are read from the shared embedding cache when that exact text was embedded
before by the same model (service/eval/embedding_cache.py), so ingesting a large judged
corpus takes seconds. Query embeddings are never cached: what is measured is unchanged.

    .venv/bin/python -m tests.load.serve_ours --listen 127.0.0.1:50051 --metrics-listen 127.0.0.1:9464 --data-dir D
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from service.api.server import serve
from service.app import App, _model_dir
from service.config import load_config
from service.eval.embedding_cache import CachedEmbedder
from service.models.onnx_embedder import load_embedder
from service.observability.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--metrics-listen", default="")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--reranker-model", default="e5-small-split-reranker-int8")
    p.add_argument("--config", default=None, help="TOML config (e.g. model_workers, max_inflight_attempts)")
    args = p.parse_args(argv)
    cfg = load_config(Path(args.config) if args.config else None, listen=args.listen, data_dir=args.data_dir,
                      metrics_listen=args.metrics_listen, reranker_model=args.reranker_model)
    configure_logging(False)
    embedder = CachedEmbedder(load_embedder(_model_dir(cfg, cfg.embedding_model), threads=cfg.model_threads))
    app = App.build(cfg, embedder=embedder)

    async def ready(addr: str) -> None:
        print(f"serving on {addr}", flush=True)

    asyncio.run(serve(app, cfg.listen, ready))
    embedder.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
