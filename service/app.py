"""Composition root: builds the engine, the model runtime, the ledger and the pipeline
from a Config. The transport (service.api) wraps an App; tests use it directly too."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from service.config import Config
from service.engines.base import Engine
from service.ingest.ingestor import Ingestor
from service.ledger.store import Ledger
from service.models.base import CrossEncoderBackend, EmbeddingBackend
from service.models.runtime import ModelRuntime
from service.pipeline.attempt import AttemptRunner

log = logging.getLogger(__name__)

DUMMY_EMBEDDER = "dummy-hash"
DUMMY_RERANKER = "dummy-overlap"


def _model_dir(cfg: Config, name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else cfg.models_dir / name


def load_embedding_backend(cfg: Config) -> EmbeddingBackend:
    if cfg.embedding_model == DUMMY_EMBEDDER:
        from service.models.dummy import HashEmbedder

        return HashEmbedder()
    from service.models.onnx_embedder import load_embedder

    path = _model_dir(cfg, cfg.embedding_model)
    if not (path / "model.onnx").exists():
        raise FileNotFoundError(
            f"embedding model not found at {path}; build it with `python -m service models build`"
        )
    return load_embedder(path, threads=cfg.model_threads)


def load_reranker_backend(cfg: Config) -> CrossEncoderBackend | None:
    if not cfg.reranker_model:
        return None
    if cfg.reranker_model == DUMMY_RERANKER:
        from service.models.dummy import OverlapCrossEncoder

        return OverlapCrossEncoder()
    from service.models.onnx_cross_encoder import load_cross_encoder

    path = _model_dir(cfg, cfg.reranker_model)
    if not (path / "model.onnx").exists():
        raise FileNotFoundError(f"reranker model not found at {path}")
    return load_cross_encoder(path, threads=cfg.model_threads)


def build_engine(cfg: Config, dimension: int) -> Engine:
    if cfg.opensearch_url:
        from service.engines.opensearch.engine import OpenSearchEngine

        return OpenSearchEngine(
            cfg.opensearch_url, index_prefix=cfg.opensearch_index_prefix, dimension=dimension,
            shards=cfg.opensearch_shards, replicas=cfg.opensearch_replicas,
        )
    from service.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(cfg.data_dir / "engine", workers=cfg.engine_workers)


@dataclass
class App:
    cfg: Config
    engine: Engine
    runtime: ModelRuntime
    ledger: Ledger
    runner: AttemptRunner
    ingestor: Ingestor

    @classmethod
    def build(
        cls, cfg: Config, *, embedder: EmbeddingBackend | None = None,
        reranker: CrossEncoderBackend | None = None, engine: Engine | None = None,
    ) -> App:
        embedder = embedder or load_embedding_backend(cfg)
        reranker = reranker if reranker is not None else load_reranker_backend(cfg)
        runtime = ModelRuntime(
            embedder, reranker, workers=cfg.model_workers, max_batch=cfg.max_batch_size,
            max_wait_ms=cfg.max_batch_wait_ms, max_queue=cfg.max_queue,
        )
        engine = engine or build_engine(cfg, embedder.dimension)
        ledger = Ledger(cfg.data_dir / "ledger.sqlite3")
        return cls(cfg, engine, runtime, ledger, AttemptRunner(cfg, engine, runtime, ledger),
                   Ingestor(cfg, engine, runtime))

    async def start(self) -> None:
        await self.ledger.start()
        await self.engine.start()
        await self.runtime.start()
        log.info("app started: engine=%s models=%s", self.engine.name, self.runner.model_ids)

    async def close(self) -> None:
        await self.runtime.close()
        await self.engine.close()
        await self.ledger.close()
