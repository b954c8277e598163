"""Service configuration: defaults, overridden by a TOML file, then by environment
variables (``RETRIEVAL_<FIELD>``), then by command-line flags."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


def default_models_dir() -> Path:
    env = os.environ.get("RETRIEVAL_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "retrieval-service" / "models"


# What a TOML string or environment variable may say for "on".
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class Config:
    listen: str = "127.0.0.1:50051"
    data_dir: Path = Path("data")
    # Engine: embedded unless an OpenSearch URL is given.
    opensearch_url: str = ""
    opensearch_index_prefix: str = "retrieval"
    opensearch_shards: int = 1
    opensearch_replicas: int = 0
    # Models. embedding_model: a directory name under models_dir, or "dummy-hash" (tests).
    # Every model setting takes a bare name (a directory under models_dir) or a path (with a
    # separator or a leading "~" or "."; relative paths resolve against the working directory).
    models_dir: Path = field(default_factory=default_models_dir)
    embedding_model: str = "multilingual-e5-small-int8"
    # A second dense leg for text without Han characters (README "The Latin-script dense
    # leg"): chunks without Han characters also get this model's vector at ingest, and
    # queries without them search it too, fused as a third leg (latin_knn_weight). "" = off;
    # "auto" (the default): bge-small-en-v1.5-int8, which `models build`
    # builds, beside the default embedder; or a directory name under models_dir. Chinese
    # queries never run it.
    latin_embedding_model: str = "auto"
    # reranker_model: "auto" = the trained default (e5-small-split-reranker-int8) once it is
    # built and its valid gate file shows it beating the tuned hybrid in en and zh; "" = off;
    # a name or path = that model. Without one the rerank leg reports SKIPPED with the reason.
    reranker_model: str = "auto"
    model_workers: int = 2  # executor threads for tokenizers + onnxruntime
    model_threads: int = 1  # intra-op threads per onnxruntime session
    max_batch_size: int = 16
    max_batch_wait_ms: float = 2.0
    max_queue: int = 256  # items waiting per model before RESOURCE_EXHAUSTED
    # Query embeddings kept (LRU, keyed by model hash + normalised query); 0 = off.
    query_cache_size: int = 4096
    # Threads for ingest's model work (passage embeddings, passage states) in a pool apart
    # from query-time model work; 0 = share the query pool. Ingest's threads (and the
    # embedded engine's writer) run ingest_nice steps below normal priority, so a bulk
    # ingest takes only the CPU that queries leave (README "Queries during a bulk ingest").
    ingest_model_workers: int = 2
    ingest_nice: int = 19
    # Of those, how many ingest may use while queries are using the models (and for 50 ms
    # after the last): on 2 cores a second ingest thread still doubles query p95.
    ingest_workers_while_querying: int = 1
    # Query-time worker threads (model pool, embedded engine searches, SQLite ledger) run
    # worker_nice steps below the event loop, so when both want a core the OS prefers the
    # loop (and the GIL it holds) over their GIL-free work: event-loop lag p99 at c=32 went
    # from the 10-25 ms bucket to <= 10 ms (README "Event-loop lag"). 0: the loop's priority.
    worker_nice: int = 10
    engine_workers: int = 1  # embedded engine executor threads (searches; writes have their own)
    # Request limits.
    max_top_k: int = 50
    default_top_k: int = 10
    max_query_chars: int = 2000
    max_inflight_attempts: int = 64  # running + waiting for a slot
    # Latency-bounded admission (service/api/attempt_queue.py), off at 0: at most this many
    # attempts run at once and the rest wait; once no slot has been free for
    # admission_interval_ms, a wait is cut at admission_target_ms (RESOURCE_EXHAUSTED) and
    # the newest waiter runs first, so admitted latency stays near the unloaded one under
    # overload. Off by default: a closed-loop caller with 32 requests out would then be shed
    # instead of queued (README "Overload").
    max_running_attempts: int = 0
    admission_target_ms: float = 5.0
    admission_interval_ms: float = 50.0
    default_deadline_s: float = 10.0  # when the caller sets none
    # Pipeline.
    candidates_per_leg: int = 50
    # Weighted RRF, tuned per language on InsuranceQA train (service/eval/fusion_tuned.json):
    # valid nDCG@10 en 0.403 (vs kNN 0.393, equal-weight k=60 0.365), zh 0.283 (vs 0.259).
    rrf_k: int = 10
    bm25_weight: float = 0.3
    knn_weight: float = 1.0
    # Queries without Han characters where the Latin-script leg runs (three legs) use these
    # instead, tuned on InsuranceQA train with the three legs (README "The Latin-script dense leg").
    latin_leg_rrf_k: int = 5
    latin_leg_bm25_weight: float = 0.8
    latin_leg_knn_weight: float = 1.0
    latin_knn_weight: float = 1.5  # the Latin-script leg's own weight
    # Queries containing Han characters use these instead.
    cjk_rrf_k: int = 10
    cjk_bm25_weight: float = 0.6
    cjk_knn_weight: float = 1.0
    retrieval_share: float = 0.6  # share of the remaining deadline for BM25/kNN legs
    # Candidates reranked: 50 since the towers (a stored pair costs a dot product; chosen on
    # train, README "Rerank depth 50"). Without stored vectors each costs a passage pass.
    rerank_top_n: int = 50
    # Final rerank order: alpha * minmax(logit) + (1 - alpha) * minmax(fused) over the head.
    # Negative: the reranker's own order (its rerank_order.json: weights over the logit, the
    # fused, BM25 and dense scores fitted on train; pipeline/head_order.py), else the alpha
    # tuned on valid for it (its gate file), else 1.0.
    rerank_alpha: float = -1.0
    # Tokens of a pair a rerank may take (a one-sequence cross-encoder: query + passage).
    rerank_max_length: int = 256
    # Split rerankers (the shipped one): tokens of a passage a rerank reads (lower and joint
    # layers), at most the model's trained cap (192 for the shipped one); 0 = that cap. Since
    # 2026-12-07 the default: with towers the cap costs nothing at query time once a
    # chunk's vector is stored, and at ingest each chunk past it costs a second pass (zh
    # 21 % of chunks at 128, 9 % at 192). Joint scoring pays per token in every rerank: 128
    # took its zh stage to 0.74x at no measured loss (README "Cached passage states").
    rerank_passage_tokens: int = 0
    # Threads a rerank's length groups run on (a reranker with the two-graph layout): one
    # pool of this many threads shared by every rerank, so a lone query on a quiet 2-core
    # machine uses both cores (rerank p50 ~0.6x) and under load the groups of concurrent
    # reranks still run on no more threads than this. 1: in the calling pool thread.
    rerank_parallel: int = 2
    # Compute the reranker's passage states at ingest and store them with each chunk, so a
    # rerank runs only the query's lower layers and the joint layers (README "Cached passage
    # states"); chunks without current states are computed at rerank time either way.
    # "auto" (2026-12-07): on with OpenSearch, where a write-back rewrites the chunk's
    # document (so write-back only fills gaps there) and without stored vectors every rerank
    # computes its whole head (rerank_top_n passage passes: hybrid + rerank ~600 ms at 50
    # against ~40 ms stored); off with the embedded engine, where write-back stores what
    # reranks compute, so ingest pays nothing. Cost when on: per chunk 391 bytes with the
    # shipped reranker's towers (~33 KB full width with joint scoring) and a second model
    # pass at ingest for the chunks one_pass below cannot serve. true / false force it.
    rerank_states: str = "auto"
    # With rerank_states: take a chunk's states from its embedding pass when the embedder's
    # input is the rerank's passage row (the reranker's lower layers are the embedder's first
    # layers; service/models/one_pass.py), so those chunks pay no second pass. Used only when
    # a probe at start finds the two models agree; false: always run the lower layers again.
    rerank_states_one_pass: bool = True
    # With the one pass: false (default) leaves the chunks it cannot serve (past the passage
    # cap: ~9 % of 500-character Chinese chunks, almost no English) without states at ingest, so
    # ingest never runs the lower layers twice; the fill below computes them once ingest is
    # quiet (the same bytes a second pass stores), and a rerank that comes first computes
    # them itself, kept by write-back: a cold Chinese corpus's reranks of 50 pairs read p50
    # ~100 ms instead of ~20 ms until then. true: a second pass at ingest, so no rerank
    # computes (Chinese ingest with states ~0.83x instead of ~0.94x of ingest without; README
    # "Ingest on OpenSearch"). Needs the fill or write-back (logged if both are off).
    rerank_states_second_pass: bool = False
    # With rerank_states: the fill (service/ingest/states_fill.py) computes the states of
    # the chunks that have none for the served reranker (those the one pass above left, or
    # stored before states were on or under another reranker) in the background, one chunk
    # at a time on one ingest thread, only once ingest has been quiet for
    # rerank_states_fill_idle_s and no query is using the models; so after a bulk load the
    # first reranks read stored states too, and bulk ingest keeps its speed. false: such a
    # chunk waits for its first rerank (write-back).
    rerank_states_fill: bool = True
    rerank_states_fill_idle_s: float = 2.0
    # Write-back: a rerank that computed a head chunk's states stores them (off the request
    # path), so only chunks that reach a rerank head pay storage and ingest pays nothing;
    # the first rerank of a chunk computes, the next ones read the same bytes (so no answer
    # changes). "auto": on with the embedded engine; with OpenSearch, where each write-back
    # rewrites the chunk's document, on only when rerank_states stores them at ingest too, so
    # it fills the gaps once per chunk (chunks ingested before, or under another reranker)
    # instead of every rerank computing those forever; true / false. README "Cached passage
    # states".
    rerank_states_write_back: str = "auto"
    # Store them down-projected (96 PCA dims, ~7.8 KB for an 80-token chunk) instead of full
    # width (int8, ~31 KB): same valid nDCG@10, but logits come out ~0.1 lower than the one
    # graph's, which the shipped quality calibration does not know (README). Joint scoring
    # only: a tower vector (rerank_scoring) is already ~0.4 KB.
    rerank_states_compact: bool = False
    # How a split reranker scores: "auto" (what its artifact's gate measured: the shipped one
    # serves two towers, README "Two towers"), "joint" (the query and passage through the
    # upper layers together) or "towers" (each side alone; its stored form is a ~0.4 KB
    # vector). A gate measured one way does not admit the other for "auto" reranking.
    rerank_scoring: str = "auto"
    # The quality gate for requests that set none (below it: INSUFFICIENT). 0: the
    # calibrations' "nothing here" gate (per leg set and language, fitted against off-domain
    # questions) on the top item, which keeps the whole list when it passes; a value in
    # (0, 1] filters items instead (1e-9: practically no gate).
    min_quality: float = 0.0
    precise_threshold: float = 0.75
    # 0: REFERENCE from the top item's calibration gate (a call the gate lets through has a
    # level), 0.5 for uncalibrated sources or a leg set without a gate.
    reference_threshold: float = 0.0
    max_context_chars: int = 6000
    # Retrieval plan rules merged over the shipped service/planning/default_rules.toml
    # (empty: the shipped rules). Validated at start: a bad file stops the server.
    plan_rules_file: str = ""
    retry_unfiltered_keys: tuple[str, ...] = ("category",)
    # A filtered attempt whose best candidate's quality (a calibrated probability) is below
    # this retries once without those keys (on the calibrated scale the hybrid alone seldom
    # reaches 0.5 even when its top answer is right).
    retry_unfiltered_below: float = 0.2
    admissible_statuses: tuple[str, ...] = ("approved",)
    # Runs.
    default_max_searches: int = 20
    default_max_results_per_search: int = 50
    # Ledger (runs, gaps, attempts): "auto" = in OpenSearch when opensearch_url is set (one
    # ledger for every replica), else SQLite; or "sqlite" / "opensearch".
    ledger_backend: str = "auto"
    # The OpenSearch ledger's cluster; "" = opensearch_url (the engine's).
    ledger_opensearch_url: str = ""
    # SQLite file; "" = <data_dir>/ledger.sqlite3. Processes on one host sharing the file
    # share budgets.
    ledger_path: str = ""
    # Longest a budget reservation waits on the ledger before the attempt is BACKEND_ERROR.
    ledger_timeout_s: float = 2.0
    # Runs older than this are purged (recorded with reason "retention"); 0 = keep forever.
    ledger_retention_days: float = 0.0
    ledger_retention_interval_s: float = 3600.0
    # A gap this critical or more counts in Run.open_critical_gaps until RESOLVED.
    critical_gap_threshold: float = 0.7
    # Auth: a TOML file of API keys -> principal and groups. Empty: auth off, every
    # caller is "anonymous" and sees public documents only.
    api_keys_file: str = ""
    # TLS (service/api/transport_security.py): certificate + key serve TLS; a client CA
    # makes it mutual, and a client certificate's subject can name the principal.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Serve a non-loopback address without auth anyway (refused otherwise).
    insecure_open: bool = False
    # Limits for anonymous callers (auth off); 0 = unlimited. Principals with keys take
    # theirs from the keys file (service/api/quotas.py).
    anonymous_requests_per_second: float = 0.0
    anonymous_burst: float = 0.0
    anonymous_max_concurrent: int = 0
    anonymous_max_searches_per_run: int = 0
    # Graceful stop: on SIGTERM, in-flight attempts and ingest streams get this long to
    # finish (a second SIGTERM stops at once).
    shutdown_grace_s: float = 10.0
    # Observability (README "Observability"). metrics_listen: HOST:PORT of the Prometheus
    # /metrics endpoint ("" = off). otlp_endpoint: an OTLP/HTTP collector base URL for
    # traces, e.g. http://127.0.0.1:4318 ("" = no traces). log_json: JSON log lines.
    metrics_listen: str = ""
    otlp_endpoint: str = ""
    trace_service_name: str = "retrieval-service"
    log_json: bool = False
    # Ingest.
    chunk_chars: int = 500
    parent_chars: int = 2000
    embed_batch: int = 16
    # IngestStream: unacknowledged documents a stream may have before the server stops
    # reading it (flow control).
    ingest_max_in_flight: int = 64

    @property
    def engine_kind(self) -> str:
        return "opensearch" if self.opensearch_url else "embedded"

    @property
    def states_at_ingest(self) -> bool:
        """``rerank_states`` resolved: auto = with OpenSearch only."""
        return _auto_flag("rerank_states", self.rerank_states, self.engine_kind == "opensearch")

    @property
    def states_write_back(self) -> bool:
        """``rerank_states_write_back`` resolved: auto = the embedded engine, or OpenSearch
        with states at ingest (write-back then only fills the chunks ingest left without)."""
        auto = self.engine_kind == "embedded" or self.states_at_ingest
        return _auto_flag("rerank_states_write_back", self.rerank_states_write_back, auto)


def _auto_flag(name: str, value: object, auto: bool) -> bool:
    """A setting that is "auto" (``auto`` decides), true or false (a bool is taken as is)."""
    word = str(value).strip().lower()
    if word == "auto":
        return auto
    if word in _TRUE_WORDS:
        return True
    if word in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"{name} must be auto, true or false, not {value!r}")


def _coerce(value: Any, current: Any) -> Any:
    if isinstance(current, bool):
        if isinstance(value, str):
            return value.lower() in _TRUE_WORDS
        return bool(value)
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    if isinstance(current, Path):
        return Path(value).expanduser()
    if isinstance(current, tuple):
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(value)
    return str(value)


def load_config(path: Path | None = None, **overrides: Any) -> Config:
    """Defaults < TOML file < RETRIEVAL_* environment < explicit overrides (None ignored)."""
    cfg = Config()
    names = {f.name for f in fields(Config)}
    values: dict[str, Any] = {}
    if path is not None:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown config keys in {path}: {sorted(unknown)}")
        values.update(data)
    for name in names:
        env = os.environ.get(f"RETRIEVAL_{name.upper()}")
        if env is not None:
            values[name] = env
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(cfg, **{k: _coerce(v, getattr(cfg, k)) for k, v in values.items()})
