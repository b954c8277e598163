"""Fuzzing every RPC's request messages with hypothesis against the real server (embedded
engine, dummy embedder so the run measures the service, not the model).

Requests are built from the proto descriptors: huge, empty and unicode strings, control
characters, query-DSL / JSON / Lucene fragments in every text field, every integer edge,
NaN and infinities, enum numbers outside the enum, deep and wide repeated fields and maps,
and raw bytes that are not valid UTF-8 in a string field at the wire level.

Pass: no INTERNAL, no UNKNOWN (an unhandled exception in a servicer), the server still
answers health afterwards. Tiers: ``FUZZ_EXAMPLES`` per RPC (default 30: the small tier in
`make test`, well under a minute); the large tier is e.g. ``FUZZ_EXAMPLES=1600`` (13 RPCs x
1600 = 20,800 requests):

    FUZZ_EXAMPLES=1600 .venv/bin/python -m pytest tests/fuzz -q -s
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from service._gen.retrieval.v1 import corpus_pb2, ledger_pb2, retrieval_pb2
from service.config import Config
from service.models.dummy import HashEmbedder
from tests.support.harness import Live, launch, shutdown

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
METHODS: list[MethodDescriptor] = [
    m for module in (retrieval_pb2, corpus_pb2, ledger_pb2) for s in module.DESCRIPTOR.services_by_name.values()
    for m in s.methods
]
NASTY = [
    "", " ", "\t\n\r", "\x00", "\x00" * 64, "\x7f\x1b[31m", "\u202e\u200b\ufeff", "💥" * 50, "如何开具发票",
    "a" * 100_000, "x " * 5000, '{"query": {"match_all": {}}}', '{"script": {"source": "System.exit(0)"}}',
    '"}, "size": 10000, "q": {"match_all": {}}, "x": {"', "*:*", "title:* OR acl:*", "source_id:*) OR (*",
    "' OR '1'='1", "\\", "\\u0000", "../../etc/passwd", "${jndi:ldap://x}", "<script>", "%s%n%x",
    "E31#0@v3", "#0@", "@", "a#-1@v1", "x#99999999999999999999@v1", "s-1#0@v1", "run-1", "gap-1",
    "internal-escalation#0@v1", "support", "doc", "faq", "category", "approved", "\ud7ff", "\U0010ffff",
]
INT_EDGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def texts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(NASTY), st.text(max_size=40),
                     st.text(alphabet=st.characters(codec="utf-8", categories=["Cc", "Cf", "Zs", "Lo", "So"]), max_size=30))


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return texts()
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width = 32 if t == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(st.floats(width=width), st.sampled_from([0.0, -0.0, 1e-300, -1.0, 0.5, 1.0, 2.0, 1e300]))
    if t == FieldDescriptor.TYPE_ENUM:
        valid = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(valid), st.integers(-(2**31), 2**31 - 1))  # open enums: any int32
    lo, hi = INT_EDGES[t]
    return st.one_of(st.sampled_from([lo, hi, 0, 1, -1 if lo < 0 else 2, 51, 1000]), st.integers(lo, hi))


def _seeds() -> dict[str, Any]:
    """Valid requests that fuzzed fields are grafted onto, so the fuzz reaches past validation."""
    from service._gen.retrieval.v1 import plan_pb2, types_pb2

    doc = corpus_pb2.Document(source_id="fz-1", version="v1", title="t", text="kayak rental at the pier",
                              collection=types_pb2.COLLECTION_DOC, acl=["support"], metadata={"category": "x"})
    retrieve = retrieval_pb2.RetrieveRequest(query="how do I reset my password", top_k=3, run_id="fz-run",
                                             filters=retrieval_pb2.Filters(metadata={"category": "pricing"}))
    return {
        "retrieval.v1.RetrieveRequest": retrieve,
        "retrieval.v1.BuildPlanRequest": plan_pb2.BuildPlanRequest(query="how do I reset my password"),
        "retrieval.v1.IngestRequest": corpus_pb2.IngestRequest(document=doc),
        "retrieval.v1.IngestStreamRequest": corpus_pb2.IngestStreamRequest(document=doc, sequence=1),
        "retrieval.v1.GetEvidenceRequest": corpus_pb2.GetEvidenceRequest(evidence_id="internal-escalation#0@v1"),
        "retrieval.v1.DeleteDocumentRequest": corpus_pb2.DeleteDocumentRequest(source_id="fz-1", version="v1"),
        "retrieval.v1.GetRunRequest": ledger_pb2.GetRunRequest(run_id="fz-run"),
        "retrieval.v1.ValidateCitationsRequest": ledger_pb2.ValidateCitationsRequest(
            run_id="fz-run", evidence_ids=["internal-escalation#0@v1"]),
        "retrieval.v1.PurgeRunRequest": ledger_pb2.PurgeRunRequest(run_id="fz-run-other", reason="fuzz"),
    }


SEEDS = _seeds()


def message(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            vs = scalar(value) if value.message_type is None else message(value.message_type, depth + 1)
            small = st.dictionaries(scalar(key), vs, max_size=4)
            wide = st.dictionaries(scalar(key), vs, min_size=50, max_size=300)
            fields[f.name] = st.one_of(small, small, wide)
            continue
        one = scalar(f) if f.message_type is None else message(f.message_type, depth + 1)
        if f.is_repeated:
            fields[f.name] = st.one_of(st.lists(one, max_size=4), st.lists(one, min_size=100, max_size=300))
        else:
            fields[f.name] = one

    seed = SEEDS.get(desc.full_name) if depth == 0 else None

    @st.composite
    def build(draw: Any) -> Any:
        msg = cls()
        names = st.lists(st.sampled_from(sorted(fields)), unique=True)
        if seed is not None and draw(st.booleans()):  # a valid request with one or two fields fuzzed
            msg.CopyFrom(seed)
            names = st.lists(st.sampled_from(sorted(fields)), unique=True, min_size=1, max_size=2)
        for name in draw(names) if fields else []:
            if desc.fields_by_name[name].is_repeated or desc.fields_by_name[name].message_type is not None:
                msg.ClearField(name)
            value = draw(fields[name])
            f = desc.fields_by_name[name]
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                target = getattr(msg, name)
                for k, v in value.items():
                    if f.message_type.fields_by_name["value"].message_type is None:
                        target[k] = v
                    else:
                        target[k].CopyFrom(v)
            elif f.is_repeated:
                if f.message_type is None:
                    getattr(msg, name).extend(value)
                else:
                    getattr(msg, name).extend(value)
            elif f.message_type is not None:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg
    return build()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wire(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A valid message's bytes, sometimes with a string field carrying bytes that are not UTF-8."""
    strings = [f.number for f in desc.fields if f.type == FieldDescriptor.TYPE_STRING]
    valid = message(desc).map(lambda m: m.SerializeToString())
    if not strings:
        return valid

    @st.composite
    def broken(draw: Any) -> bytes:
        number = draw(st.sampled_from(strings))
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80b"]))
        return draw(valid) + _varint((number << 3) | 2) + _varint(len(junk)) + junk
    return st.one_of(valid, valid, broken())


class Background:
    """The real server on its own event loop thread, so hypothesis drives it with sync calls."""

    def __init__(self, data: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = dataclasses.replace(Config(), data_dir=data, reranker_model="", default_deadline_s=5.0)
        self.live: Live = self.run(launch(cfg, HashEmbedder(), demo=True))

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def close(self) -> None:
        self.run(shutdown(self.live))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    bg = Background(tmp_path_factory.mktemp("fuzz"))
    yield bg
    bg.close()


TALLY: collections.Counter[tuple[str, str]] = collections.Counter()


def _call(channel: grpc.Channel, method: MethodDescriptor, payloads: list[bytes]) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    ident = lambda b: b  # noqa: E731 (raw bytes both ways)
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path, ident, ident)(iter(payloads), timeout=10):
                pass
        elif method.client_streaming:
            channel.stream_unary(path, ident, ident)(iter(payloads), timeout=10)
        elif method.server_streaming:
            for _ in channel.unary_stream(path, ident, ident)(payloads[0], timeout=10):
                pass
        else:
            channel.unary_unary(path, ident, ident)(payloads[0], timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        if code in FORBIDDEN:  # say it now: shrinking against a live server can take minutes
            print(f"\nFORBIDDEN {path}: {code.name}: {err.details()} request={payloads[0][:300]!r}", flush=True)  # type: ignore[attr-defined]
        assert code not in FORBIDDEN, f"{path}: {code.name}: {err.details()}"  # type: ignore[attr-defined]
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # ours carry a retry delay; the transport's do not
            trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
            if "retry-after-ms" not in trailers:
                print(f"\nNO RETRY DELAY {path}: {err.details()} request={payloads[0][:300]!r}", flush=True)  # type: ignore[attr-defined]
            assert "retry-after-ms" in trailers, f"{path}: RESOURCE_EXHAUSTED without a retry delay: {err.details()}"  # type: ignore[attr-defined]
        return code


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_fuzz_rpc(server: Background, method: MethodDescriptor) -> None:
    channel = grpc.insecure_channel(server.live.target)
    payloads = st.lists(wire(method.input_type), min_size=1, max_size=3) if method.client_streaming \
        else wire(method.input_type).map(lambda b: [b])

    # The large tier reports the first failing request as it is (no shrinking: against a live
    # server it can take longer than the run).
    phases = list(Phase) if EXAMPLES <= 100 else [Phase.explicit, Phase.generate]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES <= 100,
              suppress_health_check=list(HealthCheck), phases=phases)
    @given(payloads)
    def fuzz(batch: list[bytes]) -> None:
        code = _call(channel, method, batch)
        TALLY[(method.name, code.name)] += 1

    try:
        fuzz()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING, "server stopped answering"
    finally:
        channel.close()
        counts = {k[1]: v for k, v in TALLY.items() if k[0] == method.name}
        print(f"\nfuzz {method.name}: {sum(counts.values())} requests {dict(sorted(counts.items()))}")


def test_huge_ids_in_errors_do_not_overflow_the_trailers(server: Background) -> None:
    channel = grpc.insecure_channel(server.live.target)
    try:
        from service._gen.retrieval.v1 import retrieval_pb2_grpc

        with pytest.raises(grpc.RpcError) as err:
            retrieval_pb2_grpc.RetrievalServiceStub(channel).GetAttempt(
                retrieval_pb2.GetAttemptRequest(attempt_id="a" * 100_000), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value  # type: ignore[attr-defined]
        assert len(err.value.details()) < 1200  # type: ignore[attr-defined]
        # 300 invalid enum values: 300 field violations would overflow the trailers too.
        many = retrieval_pb2.RetrieveRequest(query="x" * 1500, top_k=3, options=retrieval_pb2.RetrievalOptions(
            legs=[2**31 - 1 - i for i in range(300)]))
        with pytest.raises(grpc.RpcError) as err:
            list(retrieval_pb2_grpc.RetrievalServiceStub(channel).Retrieve(many, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value  # type: ignore[attr-defined]
    finally:
        channel.close()


@pytest.mark.parametrize("name", ["Lookup", "Retrieve", "GetEvidence", "Ingest", "IngestStream"])
def test_bytes_that_are_not_utf8_are_invalid_argument(server: Background, name: str) -> None:
    method = next(m for m in METHODS if m.name == name)
    field = next(f for f in method.input_type.fields if f.type == FieldDescriptor.TYPE_STRING
                 or f.message_type is not None)
    junk = b"\xff\xfe"
    if field.type == FieldDescriptor.TYPE_STRING:
        payload = _varint((field.number << 3) | 2) + _varint(len(junk)) + junk
    else:  # a Document whose source_id (field 1) is not UTF-8
        inner = b"\x0a" + _varint(len(junk)) + junk
        payload = _varint((field.number << 3) | 2) + _varint(len(inner)) + inner
    channel = grpc.insecure_channel(server.live.target)
    try:
        with pytest.raises(grpc.RpcError) as err:
            path = f"/{method.containing_service.full_name}/{method.name}"
            ident = lambda b: b  # noqa: E731
            if method.client_streaming and method.server_streaming:
                list(channel.stream_stream(path, ident, ident)(iter([payload]), timeout=10))
            elif method.client_streaming:
                channel.stream_unary(path, ident, ident)(iter([payload]), timeout=10)
            elif method.server_streaming:
                list(channel.unary_stream(path, ident, ident)(payload, timeout=10))
            else:
                channel.unary_unary(path, ident, ident)(payload, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value  # type: ignore[attr-defined]
        assert "not a valid protobuf message" in err.value.details()  # type: ignore[attr-defined]
    finally:
        channel.close()
