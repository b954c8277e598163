"""The contract every engine meets, run against each kind in conftest.ENGINE_KINDS.

Written only against ``service.engines.base.Engine``: BM25 scores are the Lucene formula
(computed here by hand), kNN is exact L2 over unit vectors, filters apply before ranking.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pytest

from service.engines.base import (
    ChunkRecord,
    Engine,
    EngineTimeout,
    EngineUnavailable,
    SearchFilter,
    make_chunk_id,
)

if TYPE_CHECKING:
    from conftest import EngineKit

DIM = 8
ALL = SearchFilter(acl_groups=None)  # no restriction at all
PUBLIC = SearchFilter()  # acl_groups=(): public chunks only
T = 5.0  # generous search timeout


def unit(*weights: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(weights)] = weights
    return v / np.linalg.norm(v)


def chunk(
    source_id: str,
    index: int,
    text: str,
    *,
    version: str = "v1",
    collection: str = "doc",
    acl: tuple[str, ...] = (),
    metadata: dict[str, str] | None = None,
    vector: np.ndarray | None = None,
    content_hash: str | None = None,
) -> ChunkRecord:
    return ChunkRecord(
        chunk_id=make_chunk_id(source_id, index, version),
        source_id=source_id,
        version=version,
        chunk_index=index,
        collection=collection,
        status="approved",
        title=f"title {source_id}",
        breadcrumb=f"{source_id} > {index}",
        text=text,
        parent_text=f"parent of {text}",
        search_text=text,
        acl=acl,
        metadata=metadata or {},
        content_hash=content_hash or f"hash-{source_id}-{version}",
        vector=vector if vector is not None else unit(1.0, index + 1.0),
    )


async def put(engine: Engine, *chunks: ChunkRecord) -> None:
    """Replace each distinct (source, version) in ``chunks`` and make it searchable."""
    docs: dict[tuple[str, str], list[ChunkRecord]] = {}
    for c in chunks:
        docs.setdefault((c.source_id, c.version), []).append(c)
    for (source_id, version), group in docs.items():
        report = await engine.replace_document(source_id, version, group)
        assert report.written == len(group) and not report.errors
    await engine.refresh()


def ids(response_hits: list) -> list[str]:  # type: ignore[type-arg]
    return [h.chunk.chunk_id for h in response_hits]


def lucene_bm25(tf: int, dl: int, avgdl: float, df: int, n: int) -> float:
    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
    return idf * tf / (tf + 1.2 * (0.25 + 0.75 * dl / avgdl))


# -- writes ----------------------------------------------------------------------------------


async def test_replace_then_read_back(engine: Engine) -> None:
    a0 = chunk("E1", 0, "alpha beta", acl=("g1",), metadata={"lang": "en"}, vector=unit(1, 0))
    a1 = chunk("E1", 1, "gamma delta")
    await put(engine, a0, a1)
    assert await engine.document_hash("E1", "v1") == "hash-E1-v1"
    assert await engine.document_hash("E1", "v2") is None
    got = await engine.get_chunks([a1.chunk_id, "missing#0@v1", a0.chunk_id])
    assert [c.chunk_id for c in got] == [a1.chunk_id, a0.chunk_id]
    back = got[1]
    for field in ("source_id", "version", "chunk_index", "collection", "status", "title",
                  "breadcrumb", "text", "parent_text", "search_text", "content_hash"):  # fmt: skip
        assert getattr(back, field) == getattr(a0, field), field
    assert tuple(back.acl) == ("g1",) and dict(back.metadata) == {"lang": "en"}
    assert back.vector is not None and np.allclose(back.vector, a0.vector, atol=1e-6)


async def test_replace_is_idempotent_and_drops_old_chunks(engine: Engine) -> None:
    first = [chunk("E1", i, f"word{i} shared") for i in range(3)]
    await put(engine, *first)
    await put(engine, *first)
    assert (await engine.stats()).chunk_count == 3
    assert len((await engine.bm25("shared", 10, ALL, T)).hits) == 3
    await put(engine, chunk("E1", 0, "replacement shared", content_hash="hash-2"))
    assert (await engine.stats()).chunk_count == 1
    assert await engine.document_hash("E1", "v1") == "hash-2"
    assert ids((await engine.bm25("shared", 10, ALL, T)).hits) == ["E1#0@v1"]
    assert await engine.get_chunks(["E1#1@v1", "E1#2@v1"]) == []


async def test_versions_coexist_and_delete_one_or_all(engine: Engine) -> None:
    await put(engine, chunk("E1", 0, "policy text", version="v1"),
              chunk("E1", 0, "policy text", version="v2"),
              chunk("E1", 1, "policy more", version="v2"),
              chunk("E2", 0, "policy other"))  # fmt: skip
    stats = await engine.stats()
    assert (stats.chunk_count, stats.document_count, stats.dimension) == (4, 3, DIM)
    assert len((await engine.bm25("policy", 10, ALL, T)).hits) == 4
    assert await engine.versions("E1") == ["v1", "v2"]
    assert await engine.versions("nope") == []
    assert await engine.delete_document("E1", "v1") == 1
    await engine.refresh()
    assert await engine.versions("E1") == ["v2"]
    assert await engine.document_hash("E1", "v1") is None
    assert await engine.document_hash("E1", "v2") == "hash-E1-v2"
    assert sorted(ids((await engine.bm25("policy", 10, ALL, T)).hits)) == [
        "E1#0@v2", "E1#1@v2", "E2#0@v1"]  # fmt: skip
    assert await engine.delete_document("E1", "v1") == 0
    await put(engine, chunk("E1", 0, "policy again", version="v3"))
    assert await engine.delete_document("E1") == 3
    await engine.refresh()
    assert ids((await engine.bm25("policy", 10, ALL, T)).hits) == ["E2#0@v1"]
    stats = await engine.stats()
    assert (stats.chunk_count, stats.document_count) == (1, 1)


async def test_get_chunks_returns_the_exact_version(engine: Engine) -> None:
    await put(engine, chunk("E1", 0, "old wording", version="v1"),
              chunk("E1", 0, "new wording", version="v2"))  # fmt: skip
    (old,) = await engine.get_chunks(["E1#0@v1"])
    (new,) = await engine.get_chunks(["E1#0@v2"])
    assert (old.version, old.text) == ("v1", "old wording")
    assert (new.version, new.text) == ("v2", "new wording")


# -- BM25 ------------------------------------------------------------------------------------


async def test_bm25_ranks_chinese_bigrams_with_lucene_scores(engine: Engine) -> None:
    await put(engine,
              chunk("A", 0, "保险理赔流程"),  # 保险 险理 理赔 赔流 流程   (dl 5)
              chunk("B", 0, "理赔 需要 保单"),  # 理赔 需要 保单           (dl 3)
              chunk("C", 0, "Insurance claim policy"),  # insurance claim policy (dl 3)
              chunk("D", 0, "保险 保险 policy"))  # 保险 保险 policy      (dl 3)  # fmt: skip
    n, avgdl = 4, 14 / 4
    response = await engine.bm25("保险理赔", 10, ALL, T)  # 保险 险理 理赔
    assert response.complete
    assert ids(response.hits) == ["A#0@v1", "D#0@v1", "B#0@v1"]
    expected = [
        lucene_bm25(1, 5, avgdl, 2, n) + lucene_bm25(1, 5, avgdl, 1, n)
        + lucene_bm25(1, 5, avgdl, 2, n),
        lucene_bm25(2, 3, avgdl, 2, n),
        lucene_bm25(1, 3, avgdl, 2, n),
    ]  # fmt: skip
    assert [h.score for h in response.hits] == pytest.approx(expected, rel=1e-5)
    assert all(h.distance is None for h in response.hits)

    english = await engine.bm25("Policy claims", 10, ALL, T)  # no stemming: "claims" misses
    assert ids(english.hits) == ["C#0@v1", "D#0@v1"]
    assert english.hits[0].score == pytest.approx(lucene_bm25(1, 3, avgdl, 2, n), rel=1e-5)
    assert (await engine.bm25("the of and", 10, ALL, T)).hits == []  # stop words only


async def test_bm25_filters_apply_before_ranking(engine: Engine) -> None:
    # The strongest matches are excluded by every filter below; k hits must still come back.
    strong = [chunk(f"S{i}", 0, "premium premium premium", collection="faq", acl=("hr",),
                    metadata={"lang": "zh"}) for i in range(5)]  # fmt: skip
    weak = [chunk(f"W{i}", 0, f"premium filler words number{i}") for i in range(3)]
    await put(engine, *strong, *weak)
    weak_ids = sorted(c.chunk_id for c in weak)
    everything = await engine.bm25("premium", 3, ALL, T)
    assert {h.chunk.source_id[0] for h in everything.hits} == {"S"}
    for flt in (
        SearchFilter(collections=("doc",), acl_groups=None),
        SearchFilter(source_ids=("W0", "W1", "W2"), acl_groups=None),
        SearchFilter(metadata={}, acl_groups=()),  # public only
        SearchFilter(acl_groups=("finance",)),  # no shared group: public only
    ):
        assert sorted(ids((await engine.bm25("premium", 3, flt, T)).hits)) == weak_ids, flt
    with_group = await engine.bm25("premium", 3, SearchFilter(acl_groups=("hr", "x")), T)
    assert {h.chunk.source_id[0] for h in with_group.hits} == {"S"}
    zh = await engine.bm25("premium", 10, SearchFilter(metadata={"lang": "zh"}, acl_groups=None), T)
    assert len(zh.hits) == 5
    none = SearchFilter(collections=("faq",), source_ids=("W0",), acl_groups=None)
    assert (await engine.bm25("premium", 3, none, T)).hits == []


# -- kNN -------------------------------------------------------------------------------------


async def test_knn_orders_by_l2_distance(engine: Engine) -> None:
    await put(engine, chunk("X", 0, "x", vector=unit(1, 0)),
              chunk("Y", 0, "y", vector=unit(0, 1)),
              chunk("XY", 0, "xy", vector=unit(1, 1)),
              chunk("Z", 0, "z", vector=unit(0, 0, 1)))  # fmt: skip
    response = await engine.knn(unit(1, 0), 3, ALL, T)
    assert ids(response.hits)[0] == "X#0@v1" and ids(response.hits)[1] == "XY#0@v1"
    assert set(ids(response.hits)[2:]) <= {"Y#0@v1", "Z#0@v1"}
    d_xy = math.sqrt(2 - 2 / math.sqrt(2))
    assert [h.distance for h in response.hits] == pytest.approx([0, d_xy, math.sqrt(2)], abs=1e-4)
    expected_scores = [1.0, 1 / (1 + d_xy**2), 1 / 3]
    assert [h.score for h in response.hits] == pytest.approx(expected_scores, abs=1e-4)


async def test_knn_filters_apply_before_ranking(engine: Engine) -> None:
    near = [chunk(f"N{i}", 0, "n", vector=unit(1, 0.01 * i), acl=("secret",)) for i in range(5)]
    far = [chunk(f"F{i}", 0, "f", vector=unit(0.1 * i, 1), collection="faq") for i in range(3)]
    await put(engine, *near, *far)
    query = unit(1, 0)
    assert {h.chunk.source_id[0] for h in (await engine.knn(query, 3, ALL, T)).hits} == {"N"}
    public = await engine.knn(query, 3, PUBLIC, T)
    assert ids(public.hits) == ["F2#0@v1", "F1#0@v1", "F0#0@v1"]
    faq = await engine.knn(query, 3, SearchFilter(collections=("faq",), acl_groups=("secret",)), T)
    assert ids(faq.hits) == ["F2#0@v1", "F1#0@v1", "F0#0@v1"]
    granted = await engine.knn(query, 2, SearchFilter(acl_groups=("secret",)), T)
    assert ids(granted.hits) == ["N0#0@v1", "N1#0@v1"]


# -- lifecycle and failures ------------------------------------------------------------------


async def test_persists_across_restart(engine_kit: EngineKit) -> None:
    if engine_kit.reopen is None:
        pytest.skip(f"{engine_kit.kind}: no restart on the same store")
    await put(engine_kit.engine, chunk("E1", 0, "保险理赔", acl=("g",), metadata={"k": "v"}),
              chunk("E1", 1, "second"), chunk("E2", 0, "保险", version="v9"))  # fmt: skip
    before = await engine_kit.engine.bm25("保险", 10, ALL, T)
    engine = await engine_kit.reopen()
    after = await engine.bm25("保险", 10, ALL, T)
    assert ids(after.hits) == ids(before.hits)
    assert [h.score for h in after.hits] == [h.score for h in before.hits]
    assert await engine.document_hash("E2", "v9") == "hash-E2-v9"
    (c,) = await engine.get_chunks(["E1#0@v1"])
    assert (c.acl, dict(c.metadata)) == (("g",), {"k": "v"})
    stats = await engine.stats()
    assert (stats.chunk_count, stats.document_count, stats.dimension) == (3, 2, DIM)


async def test_every_call_fails_unavailable_after_close(engine: Engine) -> None:
    await put(engine, chunk("E1", 0, "text"))
    await engine.close()
    assert not await engine.ready()
    calls = [
        engine.bm25("text", 3, ALL, T),
        engine.knn(unit(1), 3, ALL, T),
        engine.get_chunks(["E1#0@v1"]),
        engine.document_hash("E1", "v1"),
        engine.replace_document("E1", "v1", [chunk("E1", 0, "x")]),
        engine.delete_document("E1"),
        engine.refresh(),
        engine.stats(),
    ]
    for call in calls:
        with pytest.raises(EngineUnavailable):
            await call


async def test_times_out_when_the_engine_is_saturated(engine_kit: EngineKit) -> None:
    if engine_kit.saturate is None:
        pytest.skip(f"{engine_kit.kind}: cannot be saturated from a test")
    engine = engine_kit.engine
    await put(engine, chunk("E1", 0, "text"))
    with engine_kit.saturate():
        with pytest.raises(EngineTimeout):
            await engine.bm25("text", 3, ALL, 0.05)
        with pytest.raises(EngineTimeout):
            await engine.knn(unit(1), 3, ALL, 0.05)
    assert ids((await engine.bm25("text", 3, ALL, T)).hits) == ["E1#0@v1"]
