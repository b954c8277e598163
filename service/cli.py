"""Command line: serve, ingest, query, lookup, models, demo-corpus.

    python -m service serve --listen 127.0.0.1:50051 --data-dir data
    python -m service ingest --target 127.0.0.1:50051 docs.jsonl
    python -m service query --target 127.0.0.1:50051 "how do I reset my password" [--json]
    python -m service plan "那审批呢" --history "报销流程是什么" [--intent follow_up --confidence 0.75]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from service.config import load_config


def _json(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True)
    return out


DEMO_HELP = """
Demo corpus loaded. Query it from another terminal:

  .venv/bin/python -m service query --target {addr} "how do I reset my password"
  .venv/bin/python -m service query --target {addr} "如何开具发票" --json
  .venv/bin/python -m service query --target {addr} "what changed in v2.4" --lookup

or with grpcurl (reflection is on):

  grpcurl -plaintext -d '{{"query": "refund policy", "top_k": 3}}' {addr} retrieval.v1.RetrievalService/Retrieve

Stop with Ctrl-C.
"""


async def _ingest_demo(app: Any) -> None:
    from service.demo.corpus import DEMO_DOCUMENTS
    from service.ingest.documents import document_from_json

    outcomes = [await app.ingestor.ingest(document_from_json(d)) for d in DEMO_DOCUMENTS]
    await app.engine.refresh()
    indexed = sum(o.status == "indexed" for o in outcomes)
    unchanged = sum(o.status == "unchanged" for o in outcomes)
    print(f"demo corpus: {indexed} documents indexed, {unchanged} unchanged", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.api.server import serve
    from service.app import App

    cfg = load_config(
        Path(args.config) if args.config else None, listen=args.listen, data_dir=args.data_dir,
        opensearch_url=args.opensearch_url, embedding_model=args.embedding_model,
        reranker_model=args.reranker_model, api_keys_file=args.api_keys, plan_rules_file=args.plan_rules,
        tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca,
        insecure_open=True if args.insecure_open else None,
        metrics_listen=args.metrics_listen, otlp_endpoint=args.otlp_endpoint, log_json=args.log_json or None,
    )
    from service.observability.logs import configure_logging

    configure_logging(cfg.log_json)
    from service.api.transport_security import ExposureError, check_exposure

    try:
        print(check_exposure(cfg, cfg.listen), flush=True)  # before loading models: fail fast
    except ExposureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from service.planning.rules import RulesError

    try:
        app = App.build(cfg)
    except RulesError as exc:
        print(f"error: invalid plan rules: {exc}", file=sys.stderr)
        return 2

    async def ready(addr: str) -> None:
        print(f"serving retrieval.v1 on {addr} (engine: {cfg.engine_kind}, data: {cfg.data_dir})", flush=True)
        if args.demo:
            await _ingest_demo(app)
            print(DEMO_HELP.format(addr=addr), flush=True)

    asyncio.run(serve(app, cfg.listen, ready))
    return 0


def _channel(args: argparse.Namespace) -> Any:
    """A channel to ``--target``: TLS when --tls-ca (or a client certificate) is given,
    the same options as the Python client's ``TlsOptions``."""
    import grpc

    if not (args.tls_ca or args.tls_cert):
        return grpc.aio.insecure_channel(args.target)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes() if args.tls_ca else None,
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None)
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.aio.secure_channel(args.target, creds, options=options)


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default="", help="CA (PEM) to verify the server with: connect over TLS")
    p.add_argument("--tls-cert", default="", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", default="", help="client private key (PEM)")
    p.add_argument("--tls-server-name", default="", help="name to verify the server certificate against")


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                yield lineno, line


def cmd_ingest(args: argparse.Namespace) -> int:
    """Stream a JSONL file through IngestStream: the progress bar counts documents the
    server acknowledged as committed; when the stream breaks the summary says what committed
    and what was not acknowledged (re-running the file indexes only what is missing)."""
    import grpc
    from tqdm import tqdm

    from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, types_pb2
    from service.ingest.documents import document_from_json

    path = Path(args.file)
    collections = {"doc": types_pb2.COLLECTION_DOC, "faq": types_pb2.COLLECTION_FAQ}
    statuses = {"approved": types_pb2.SOURCE_STATUS_APPROVED, "draft": types_pb2.SOURCE_STATUS_DRAFT,
                "retired": types_pb2.SOURCE_STATUS_RETIRED}
    docs: list[tuple[int, Any]] = []  # (line number = the document's sequence, Document)
    local_errors = 0
    for lineno, line in _read_jsonl(path):
        try:
            d = document_from_json(json.loads(line))
        except ValueError as exc:
            print(f"{path}:{lineno}: skipped: {exc}", file=sys.stderr)
            local_errors += 1
            continue
        docs.append((lineno, corpus_pb2.Document(
            source_id=d.source_id, version=d.version, title=d.title, text=d.text,
            collection=collections.get(d.collection, types_pb2.COLLECTION_UNSPECIFIED),
            status=statuses.get(d.status, types_pb2.SOURCE_STATUS_UNSPECIFIED),
            acl=list(d.acl), breadcrumb=d.breadcrumb, metadata=d.metadata)))
    acks: dict[int, Any] = {}
    sent = 0
    broken: grpc.aio.AioRpcError | None = None
    started = time.monotonic()

    async def run() -> None:
        nonlocal sent, broken
        window = asyncio.Semaphore(max(1, args.window))  # unacknowledged documents we send ahead
        async with _channel(args) as channel:
            stub = corpus_pb2_grpc.CorpusServiceStub(channel)
            bar = tqdm(total=len(docs), unit="doc", desc="committed", file=sys.stderr)

            async def requests() -> AsyncIterator[corpus_pb2.IngestStreamRequest]:
                nonlocal sent
                for lineno, doc in docs:
                    await window.acquire()
                    sent += 1
                    yield corpus_pb2.IngestStreamRequest(document=doc, sequence=lineno)

            metadata = (("x-api-key", args.api_key),) if args.api_key else None
            try:
                async for response in stub.IngestStream(requests(), metadata=metadata):
                    for ack in response.acks:
                        acks[ack.sequence] = ack
                        window.release()
                    bar.update(len(response.acks))
            except grpc.aio.AioRpcError as err:
                broken = err
            bar.close()

    asyncio.run(run())
    by_status = {name: [a for a in acks.values() if a.status == value] for name, value in (
        ("indexed", corpus_pb2.DOCUMENT_STATUS_INDEXED), ("unchanged", corpus_pb2.DOCUMENT_STATUS_UNCHANGED),
        ("invalid", corpus_pb2.DOCUMENT_STATUS_INVALID), ("failed", corpus_pb2.DOCUMENT_STATUS_FAILED))}
    errors = sorted(by_status["invalid"] + by_status["failed"], key=lambda a: a.sequence)
    unacked = [(lineno, doc) for lineno, doc in docs if lineno not in acks]
    elapsed = time.monotonic() - started
    chunks = sum(a.chunks for a in by_status["indexed"])
    if args.json:
        print(json.dumps({
            "documents_sent": sent, "documents_acknowledged": len(acks),
            **{f"documents_{k}": len(v) for k, v in by_status.items()}, "chunks_indexed": chunks,
            "errors": [_json(a) for a in errors], "not_acknowledged_lines": [n for n, _ in unacked],
            "stream_error": f"{broken.code().name}: {broken.details()}" if broken else "",
            "elapsed_ms": elapsed * 1000}, ensure_ascii=False, indent=2))
    else:
        print(f"received {len(acks)}, indexed {len(by_status['indexed'])}, unchanged {len(by_status['unchanged'])}, "
              f"chunks {chunks}, {chunks / elapsed if elapsed > 0 else 0.0:.1f} chunks/s, {len(errors)} errors")
        for a in errors:
            print(f"  line {a.sequence} {a.source_id}@{a.version}: {a.field} {a.message}")
        if broken is not None:
            committed = len(by_status["indexed"]) + len(by_status["unchanged"])
            print(f"stream broke ({broken.code().name}: {broken.details()}): {committed} documents committed; "
                  f"{len(unacked)} not acknowledged ({sent - len(acks)} sent without an ack, {len(docs) - sent} "
                  f"never sent), first at line {unacked[0][0] if unacked else '-'}; re-run the same file to "
                  "index only what is missing")
    if broken is not None:
        return 3
    return 1 if errors or local_errors else 0


def _request(args: argparse.Namespace) -> Any:
    from service._gen.retrieval.v1 import retrieval_pb2, types_pb2

    req = retrieval_pb2.RetrieveRequest(query=args.query, top_k=args.top_k, run_id=args.run_id or "")
    for c in args.collection or []:
        req.filters.collections.append(types_pb2.Collection.Value(f"COLLECTION_{c.upper()}"))
    for kv in args.meta or []:
        k, _, v = kv.partition("=")
        req.filters.metadata[k] = v
    for leg in args.leg or []:
        req.options.legs.append(types_pb2.LegKind.Value(f"LEG_KIND_{leg.upper()}"))
    if args.rerank:
        req.options.rerank = types_pb2.RerankMode.Value(f"RERANK_MODE_{args.rerank.upper()}")
    req.history.extend(args.history or [])
    req.query_variants.extend(args.variant or [])
    if args.plan or args.intent:  # the server builds the plan (classifying when no --intent)
        req.intent.CopyFrom(_intent(args))
    return req


def _intent(args: argparse.Namespace) -> Any:
    from service._gen.retrieval.v1 import plan_pb2

    signals = plan_pb2.IntentSignals()
    if args.intent:
        signals.intent = plan_pb2.Intent.Value(f"INTENT_{args.intent.upper()}")
    if args.rule_score is not None:
        signals.rule_score = args.rule_score
    if args.confidence is not None:
        signals.confidence = args.confidence
    return signals


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan the server would execute (BuildPlan); nothing is searched."""
    import grpc

    from service._gen.retrieval.v1 import plan_pb2, retrieval_pb2_grpc

    async def run() -> int:
        async with _channel(args) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            metadata = (("x-api-key", args.api_key),) if args.api_key else None
            req = plan_pb2.BuildPlanRequest(query=args.query, history=args.history or [], intent=_intent(args))
            try:
                res = await stub.BuildPlan(req, timeout=args.timeout, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
                return 2
            print(json.dumps(MessageToDict(res, preserving_proto_field_name=True,
                                           always_print_fields_with_no_presence=True), ensure_ascii=False, indent=2))
        return 0

    return asyncio.run(run())


def _print_event(ev: Any) -> None:
    from service._gen.retrieval.v1 import types_pb2

    kind = ev.WhichOneof("event")
    if kind == "leg":
        leg = ev.leg
        detail = f" ({leg.detail})" if leg.detail else ""
        print(f"leg {types_pb2.LegKind.Name(leg.kind)[9:]:<6} {types_pb2.LegStatus.Name(leg.status)[11:]:<8}"
              f" {leg.latency_ms:7.1f} ms  {leg.hit_count} hits{detail}")
    elif kind == "evidence":
        e = ev.evidence
        print(f"\n#{e.rank} {e.evidence_id}  {e.title}  [quality {e.quality:.3f}]")
        if e.breadcrumb:
            print(f"   {e.breadcrumb}")
        print("   " + e.excerpt.replace("\n", " ")[:300])
    else:
        r = ev.result
        if r.HasField("plan"):
            print(f"\nplan {r.plan.reason}  variants {list(r.query_variants)}  faq_direct {r.faq_direct}")
        print(f"\noutcome {types_pb2.AttemptOutcome.Name(r.outcome)[16:]}  "
              f"relevance {types_pb2.RelevanceLevel.Name(r.relevance_level)[16:] or 'NONE'}  "
              f"returned {r.returned_count}  degraded {r.degraded}  truncated {r.truncated}  "
              f"{r.timing.total_ms:.1f} ms  attempt {r.attempt_id}")


def cmd_query(args: argparse.Namespace) -> int:
    import grpc

    from service._gen.retrieval.v1 import retrieval_pb2_grpc

    async def run() -> int:
        async with _channel(args) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            metadata = (("x-api-key", args.api_key),) if args.api_key else None
            try:
                if args.lookup:
                    res = await stub.Lookup(_request(args), timeout=args.timeout, metadata=metadata)
                    print(json.dumps(_json(res), ensure_ascii=False, indent=2))
                    return 0
                async for ev in stub.Retrieve(_request(args), timeout=args.timeout, metadata=metadata):
                    if args.json:
                        print(json.dumps(_json(ev), ensure_ascii=False))
                    else:
                        _print_event(ev)
            except grpc.aio.AioRpcError as err:
                print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
                return 2
        return 0

    return asyncio.run(run())


def cmd_models(args: argparse.Namespace) -> int:
    from service.offline.builder import build_all, default_models_dir

    out = Path(args.out) if args.out else default_models_dir()
    for path in build_all(out, force=args.force, bge=args.bge):
        print(path)
    return 0


def cmd_train_reranker(args: argparse.Namespace) -> int:
    from service.offline.builder import default_models_dir
    from service.offline.training.pipeline import run_pipeline

    models_dir = Path(args.out) if args.out else default_models_dir()
    if args.arch == "split":
        from service.offline.training.pipeline import run_split_pipeline

        from service.offline.builder.e5 import model_id

        mine_with = Path(args.mine_with) if args.mine_with else models_dir / model_id("int8", adapted=True)
        run_split_pipeline(pack=Path(args.pack), cache=Path(args.cache), work=Path(args.work), models_dir=models_dir,
                           name=args.name or "e5-small-split-reranker", langs=args.langs, minutes=args.minutes or 30.0,
                           resume=args.resume, repack=args.repack,
                           artifact=Path(args.artifact) if args.artifact else None,
                           lower=args.lower, upper=args.upper, init_upper=args.init_upper, mine_with=mine_with)
        return 0
    run_pipeline(pack=Path(args.pack), work=Path(args.work), models_dir=models_dir,
                 name=args.name or "e5-small-reranker", langs=args.langs, device=args.device, minutes=args.minutes,
                 layers=args.layers, max_len=args.max_len, epochs=args.epochs, lr=args.lr, resume=args.resume,
                 repack=args.repack)
    return 0


def cmd_demo_corpus(args: argparse.Namespace) -> int:
    from service.demo.corpus import write_demo_corpus

    n = write_demo_corpus(Path(args.out))
    print(f"wrote {n} documents to {args.out}")
    return 0


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--history", action="append", help="an earlier question of the conversation (repeat, oldest first)")
    p.add_argument("--intent", choices=["faq_query", "knowledge_query", "follow_up", "greeting", "handoff",
                                        "out_of_scope"], help="the caller's intent (default: the server classifies)")
    p.add_argument("--rule-score", type=float, default=None)
    p.add_argument("--confidence", type=float, default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the gRPC server")
    s.add_argument("--listen", default=None, help="HOST:PORT (default 127.0.0.1:50051)")
    s.add_argument("--data-dir", default=None, help="embedded engine + ledger directory")
    s.add_argument("--opensearch-url", default=None, help="use OpenSearch instead of the embedded engine")
    s.add_argument("--embedding-model", default=None)
    s.add_argument("--reranker-model", default=None)
    s.add_argument("--api-keys", default=None, help="TOML file of API keys (enables auth)")
    s.add_argument("--config", default=None, help="TOML config file")
    s.add_argument("--plan-rules", default=None, help="TOML plan rules merged over the shipped ones")
    s.add_argument("--demo", action="store_true", help="ingest the demo corpus once serving")
    s.add_argument("--tls-cert", default=None, help="server certificate (PEM): serve TLS")
    s.add_argument("--tls-key", default=None, help="server private key (PEM)")
    s.add_argument("--tls-client-ca", default=None, help="CA (PEM) client certificates must chain to (mutual TLS)")
    s.add_argument("--insecure-open", action="store_true",
                   help="allow a non-loopback address without auth (refused otherwise)")
    s.add_argument("--metrics-listen", default=None, help="HOST:PORT for Prometheus /metrics (default: off)")
    s.add_argument("--otlp-endpoint", default=None, help="OTLP/HTTP collector for traces, e.g. http://127.0.0.1:4318 "
                                                         "(default: off)")
    s.add_argument("--log-json", action="store_true", help="JSON log lines with the attempt id")
    s.set_defaults(fn=cmd_serve)

    i = sub.add_parser("ingest", help="stream a JSONL file of documents into the server")
    i.add_argument("file")
    i.add_argument("--target", default="127.0.0.1:50051")
    i.add_argument("--api-key", default="")
    i.add_argument("--json", action="store_true")
    i.add_argument("--window", type=int, default=64, help="documents sent ahead of their acknowledgement")
    _client_arguments(i)
    i.set_defaults(fn=cmd_ingest)

    q = sub.add_parser("query", help="run one attempt and print its event stream")
    q.add_argument("query")
    q.add_argument("--target", default="127.0.0.1:50051")
    q.add_argument("--top-k", type=int, default=5)
    q.add_argument("--run-id", default="")
    q.add_argument("--collection", action="append", choices=["doc", "faq"])
    q.add_argument("--meta", action="append", help="metadata filter KEY=VALUE")
    q.add_argument("--leg", action="append", choices=["bm25", "knn", "knn_latin"])
    q.add_argument("--rerank", choices=["on", "off"])
    q.add_argument("--timeout", type=float, default=10.0)
    q.add_argument("--api-key", default="")
    q.add_argument("--json", action="store_true", help="one JSON object per event")
    _client_arguments(q)
    q.add_argument("--lookup", action="store_true", help="call Lookup (agent projection) instead")
    _plan_arguments(q)
    q.add_argument("--plan", action="store_true", help="execute a retrieval plan built by the server from intent")
    q.add_argument("--variant", action="append", help="an extra phrasing of the query (fused with RRF)")
    q.set_defaults(fn=cmd_query)

    pl = sub.add_parser("plan", help="print the retrieval plan the server builds for a question (BuildPlan)")
    pl.add_argument("query")
    pl.add_argument("--target", default="127.0.0.1:50051")
    pl.add_argument("--timeout", type=float, default=10.0)
    pl.add_argument("--api-key", default="")
    _client_arguments(pl)
    _plan_arguments(pl)
    pl.set_defaults(fn=cmd_plan)

    m = sub.add_parser("models", help="model tools")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    b = msub.add_parser("build", help="build ONNX models from weights shipped in registry packages")
    b.add_argument("--out", default=None)
    b.add_argument("--force", action="store_true")
    b.add_argument("--no-bge", dest="bge", action="store_false", help="skip the carded bge-small embedders (built "
                   "from their Maven jars by default; bge-small-en is the Latin-script leg's embedder)")
    b.set_defaults(fn=cmd_models)
    t = msub.add_parser("train-reranker", help="pack -> train -> ship the cross-encoder (split: ~1 h on 2 CPU cores; "
                        "joint: hours per epoch on CPU, see service/offline/training/DEVICE.md for a GPU)")
    t.add_argument("--arch", choices=["split", "joint"], default="split",
                   help="split: lower e5 layers cached, upper layers trained (the default reranker); "
                        "joint: a full cross-encoder (GPU)")
    t.add_argument("--pack", default=".cache/train-pack")
    t.add_argument("--cache", default=".cache/split-cache", help="split: lower-layer states (~5 GB)")
    t.add_argument("--work", default=".cache/train-reranker", help="weights, metrics, checkpoints")
    t.add_argument("--out", default=None, help="models dir (default: the builder's)")
    t.add_argument("--name", default=None, help="default e5-small-split-reranker / e5-small-reranker")
    t.add_argument("--langs", default="en,zh")
    t.add_argument("--device", default=None)
    t.add_argument("--minutes", type=float, default=None, help="training wall-clock budget")
    t.add_argument("--lower", type=int, default=9, help="split: frozen lower e5 layers (the shipped reranker: 9)")
    t.add_argument("--upper", type=int, default=3, help="split: trained joint layers (the shipped reranker: 3)")
    t.add_argument("--init-upper", choices=["wheel", "adapted"], default="adapted",
                   help="split: start the joint layers from the wheel's e5 or the InsuranceQA-adapted one's")
    t.add_argument("--mine-with", default=None, help="split: embedding model dir whose dense leg mines the pack's "
                   "negatives (default: the models dir's multilingual-e5-small-iqa-int8, as the shipped reranker)")
    t.add_argument("--layers", type=int, default=12)
    t.add_argument("--max-len", type=int, default=256)
    t.add_argument("--epochs", type=float, default=3.0)
    t.add_argument("--lr", type=float, default=5e-5)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--repack", action="store_true")
    t.add_argument("--artifact", default=None,
                   help="split: where the compact artifact (delta.npz + card.json) goes (default: the shipped one, "
                        "service/offline/builder/artifacts/NAME)")
    t.set_defaults(fn=cmd_train_reranker)

    d = sub.add_parser("demo-corpus", help="write the demo corpus JSONL")
    d.add_argument("--out", default="data/demo.jsonl")
    d.set_defaults(fn=cmd_demo_corpus)

    from service.eval.cli import add_eval_parser  # light: the runner loads on use

    add_eval_parser(sub)

    args = p.parse_args(argv)
    try:
        rc: int = args.fn(args)
    except BrokenPipeError:
        # The reader went away (`query ... | head`): stop quietly, as other command-line tools
        # do. Point stdout at devnull so the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a process killed by it
    return rc
