"""ACL leak hunt on both engines: principals with random groups query a corpus with
random ACLs. A caller must learn nothing about documents it may not see:

- evidence: every item returned is visible to the caller;
- counts: retrieved_count equals that of an oracle server holding only the caller's
  visible documents (so hidden documents never count, not even as candidates);
- GetEvidence of a hidden id (and of a hidden source's other chunks) answers exactly like a
  never-ingested id: same fidelity, no evidence, no versions.

``LEAK_QUERIES`` sets the number of randomized queries (default 200 in `make test`;
10,000 for the full hunt). Seeded: ``LEAK_SEED``. On OpenSearch, the server under test and
every oracle have their own index prefix on the test node (ACL terms filter inside the
OpenSearch query, exactly where a leak would be).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from service.models.dummy import HashEmbedder
from tests.support.harness import Live, StartServer, evidence_of, result_of
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix

QUERIES = int(os.environ.get("LEAK_QUERIES", "200"))
SEED = int(os.environ.get("LEAK_SEED", "12"))
GROUPS = [f"g{i}" for i in range(5)]
VOCAB = ("kayak pier rental invoice refund password reset escalation pager billing tax policy holiday "
         "contract storage backup outage region latency quota audit secret salary merger roadmap").split()


def _corpus(rng: random.Random, n: int = 60) -> list[tuple[corpus_pb2.Document, tuple[str, ...]]]:
    docs = []
    for i in range(n):
        acl: tuple[str, ...] = () if rng.random() < 0.3 else tuple(sorted(rng.sample(GROUPS, rng.randint(1, 2))))
        words = " ".join(rng.choice(VOCAB) for _ in range(12))
        docs.append((corpus_pb2.Document(
            source_id=f"d{i}", version="v1", title=f"note {i}", text=f"{words} tok{i}",
            collection=types_pb2.COLLECTION_DOC, acl=list(acl)), acl))
    return docs


def _visible(acl: tuple[str, ...], groups: tuple[str, ...]) -> bool:
    return not acl or bool(set(acl) & set(groups))


EngineConfig = Callable[..., dict[str, Any]]


@pytest.fixture(params=["embedded", pytest.param("opensearch", marks=pytest.mark.integration)])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, EngineConfig]]:
    """The engine's name, and the config overrides for one more server on it: none for the
    embedded engine; the node's URL and a fresh index prefix (dropped afterwards) for OpenSearch."""
    if request.param == "embedded":
        yield "embedded", lambda **overrides: overrides
        return
    url = opensearch_url_or_skip()
    prefixes: list[str] = []

    def on_opensearch(**overrides: Any) -> dict[str, Any]:
        prefixes.append(unique_prefix("acl"))
        return {"opensearch_url": url, "opensearch_index_prefix": prefixes[-1], **overrides}

    yield "opensearch", on_opensearch
    for prefix in prefixes:
        drop_prefix(url, prefix)


async def test_randomized_principals_learn_nothing_about_hidden_documents(
        start_server: StartServer, tmp_path: Path, engine: tuple[str, EngineConfig]) -> None:
    engine_name, on_engine = engine
    rng = random.Random(SEED)
    corpus = _corpus(rng)
    principals = {f"p{i}": tuple(sorted(rng.sample(GROUPS, k))) for i, k in enumerate((0, 1, 1, 2, 3))}
    keys = tmp_path / "keys.toml"
    keys.write_text("[[principals]]\nname = \"writer\"\napi_key = \"k-writer\"\ngroups = []\n\n" + "\n".join(
        f'[[principals]]\nname = "{p}"\napi_key = "k-{p}"\ngroups = {list(g)!r}\n'.replace("'", '"')
        for p, g in principals.items()))
    main = await start_server(embedder=HashEmbedder(), demo=False, **on_engine(api_keys_file=str(keys)))
    summary = await main.ingest([d for d, _ in corpus], metadata=(("x-api-key", "k-writer"),))
    assert summary.documents_indexed == len(corpus), summary
    # One oracle per principal: only what it may see, stored as public.
    oracles: dict[str, Live] = {}
    for p, groups in principals.items():
        oracles[p] = await start_server(embedder=HashEmbedder(), demo=False, **on_engine())
        mine = []
        for d, acl in corpus:
            if _visible(acl, groups):
                public = corpus_pb2.Document()
                public.CopyFrom(d)
                del public.acl[:]
                mine.append(public)
        if mine:
            await oracles[p].ingest(mine)

    leaks: list[str] = []
    checked = 0
    for q in range(QUERIES):
        p = rng.choice(sorted(principals))
        words = rng.sample(VOCAB, rng.randint(1, 3))
        if rng.random() < 0.5:
            words.append(f"tok{rng.randrange(len(corpus))}")  # aim at one document, often a hidden one
        req = dict(query=" ".join(words), top_k=rng.choice((1, 5, 10)))
        got = await main.retrieve(metadata=(("x-api-key", f"k-{p}"),), **req)
        want = await oracles[p].retrieve(**req)
        for ev in evidence_of(got):
            acl = corpus[int(ev.source_id[1:])][1]
            if not _visible(acl, principals[p]):
                leaks.append(f"query {q} {p}{principals[p]}: evidence {ev.evidence_id} (acl {acl})")
        if result_of(got).retrieved_count != result_of(want).retrieved_count:
            leaks.append(f"query {q} {p}: retrieved_count {result_of(got).retrieved_count} "
                         f"vs {result_of(want).retrieved_count} over its visible documents")
        checked += 1

    # Another principal's attempt record (its query and the evidence it saw) is NOT_FOUND.
    other = result_of(await main.retrieve(metadata=(("x-api-key", "k-p4"),), query="secret salary", top_k=5))
    for p in ("p0", "p1"):
        try:
            await main.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=other.attempt_id),
                                            metadata=(("x-api-key", f"k-{p}"),))
            leaks.append(f"{p}: GetAttempt of p4's attempt answered")
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                leaks.append(f"{p}: GetAttempt of p4's attempt: {err.code().name}")
    mine = await main.retrieval.GetAttempt(retrieval_pb2.GetAttemptRequest(attempt_id=other.attempt_id),
                                           metadata=(("x-api-key", "k-p4"),))
    assert mine.attempt.principal == "p4"

    evidence_checks = 0
    for p, groups in principals.items():
        md = (("x-api-key", f"k-{p}"),)
        unknown = await main.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id="never-ingested#0@v1"), metadata=md)
        for i, (_, acl) in enumerate(corpus):
            for eid in (f"d{i}#0@v1", f"d{i}#3@v1", f"d{i}#0@v9"):
                got = await main.corpus.GetEvidence(corpus_pb2.GetEvidenceRequest(evidence_id=eid), metadata=md)
                evidence_checks += 1
                if not _visible(acl, groups) and got != unknown:
                    leaks.append(f"{p}: GetEvidence({eid}) of a hidden document differs from an unknown id: {got}")
                if _visible(acl, groups) and eid.endswith("#0@v1") and got.fidelity != corpus_pb2.FIDELITY_EXACT:
                    leaks.append(f"{p}: GetEvidence({eid}) of a visible document is not EXACT")
    print(f"\nACL leak hunt ({engine_name}): {checked} queries by {len(principals)} principals over {len(corpus)} documents, "
          f"{evidence_checks} GetEvidence checks: {len(leaks)} leaks")
    assert not leaks, "\n".join(leaks[:20])
