from __future__ import annotations

import math

import pytest

from service.domain import QualitySource, RelevanceLevel
from service.engines.base import ChunkRecord, Hit
from service.pipeline.fusion import Candidate, max_rrf_score, rrf
from service.pipeline.postprocess import Deduped, admissible, apply_context_budget, dedupe
from service.pipeline.relevance import assign_quality, relevance_level


def chunk(cid: str, text: str = "t", parent: str | None = None, status: str = "approved",
          source: str | None = None, version: str = "v1") -> ChunkRecord:
    return ChunkRecord(chunk_id=cid, source_id=source or cid, version=version, chunk_index=0,
                       collection="doc", status=status, title=cid, breadcrumb="", text=text,
                       parent_text=parent if parent is not None else text, search_text=text)


def test_rrf_scores_and_order() -> None:
    a, b, c = chunk("a"), chunk("b"), chunk("c")
    fused = rrf([Hit(a, 9.0), Hit(b, 5.0)], [Hit(b, 0.9, 0.2), Hit(c, 0.8, 0.4)], k=60)
    scores = {x.chunk.chunk_id: x.fused_score for x in fused}
    assert scores["b"] == pytest.approx(1 / 62 + 1 / 61)
    assert scores["a"] == pytest.approx(1 / 61)
    assert scores["c"] == pytest.approx(1 / 62)
    assert [x.chunk.chunk_id for x in fused] == ["b", "a", "c"]
    b_c = next(x for x in fused if x.chunk.chunk_id == "b")
    assert (b_c.bm25_rank, b_c.knn_rank, b_c.bm25_score, b_c.distance) == (2, 1, 5.0, 0.2)


def test_rrf_weights_shift_order() -> None:
    a, c = chunk("a"), chunk("c")
    fused = rrf([Hit(a, 1.0)], [Hit(c, 1.0, 0.1)], k=60, bm25_weight=0.5, knn_weight=1.0)
    assert [x.chunk.chunk_id for x in fused] == ["c", "a"]


def test_rrf_fuses_the_latin_leg_as_a_third_list() -> None:
    a, b, c = chunk("a"), chunk("b"), chunk("c")
    fused = rrf([Hit(a, 9.0)], [Hit(b, 0.9, 0.2)], k=5, bm25_weight=0.8, knn_weight=1.0,
                latin=[Hit(c, 0.9, 0.3), Hit(b, 0.8, 0.5)], latin_weight=1.5)
    scores = {x.chunk.chunk_id: x.fused_score for x in fused}
    assert scores == pytest.approx({"a": 0.8 / 6, "b": 1 / 6 + 1.5 / 7, "c": 1.5 / 6})
    assert [x.chunk.chunk_id for x in fused] == ["b", "c", "a"]
    b_c = fused[0]
    assert (b_c.knn_rank, b_c.latin_rank, b_c.distance, b_c.latin_distance) == (1, 2, 0.2, 0.5)
    assert b_c.latin_dense_score == pytest.approx(1 - 0.25 / 2) and fused[2].latin_dense_score is None
    assert max_rrf_score([0.8, 1.0, 1.5], 5) == pytest.approx(3.3 / 6)


def test_quality_sources() -> None:
    c = Candidate(chunk("a"), fused_score=1 / 61, distance=0.5, rerank_score=2.0)
    assert assign_quality(c, reranked=True, max_fused=2 / 61) is QualitySource.RERANKER_PROBABILITY
    assert c.quality == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert assign_quality(c, reranked=False, max_fused=2 / 61) is QualitySource.DENSE_DISTANCE
    assert c.quality == pytest.approx(0.75)  # 1 - 0.5 / 2
    assert c.dense_score == pytest.approx(1 - 0.25 / 2)
    lexical_only = Candidate(chunk("b"), fused_score=1 / 61)
    assert assign_quality(lexical_only, reranked=False, max_fused=max_rrf_score([1, 1], 60)) is QualitySource.RANK_FALLBACK
    assert lexical_only.quality == pytest.approx(0.5)


@pytest.mark.parametrize("q,level", [(None, RelevanceLevel.NONE), (0.9, RelevanceLevel.PRECISE),
                                     (0.75, RelevanceLevel.PRECISE), (0.6, RelevanceLevel.REFERENCE),
                                     (0.5, RelevanceLevel.REFERENCE), (0.49, RelevanceLevel.NONE)])
def test_relevance_thresholds(q: float | None, level: RelevanceLevel) -> None:
    assert relevance_level(q, 0.75, 0.5) is level


def test_admissibility_status_and_pins() -> None:
    ok = Candidate(chunk("a", source="s", version="v2"))
    draft = Candidate(chunk("b", status="draft"))
    assert admissible(ok, ("approved",), {})
    assert not admissible(draft, ("approved",), {})
    assert admissible(draft, ("approved", "draft"), {})
    assert admissible(ok, ("approved",), {"s": "v2"})
    assert not admissible(ok, ("approved",), {"s": "v3"})


def test_dedupe_keeps_best_child_per_parent_and_drops_repeated_text() -> None:
    p = "parent section"
    first = Candidate(chunk("s#0@v1", "child one", p, source="s"))
    sibling = Candidate(chunk("s#1@v1", "child two", p, source="s"))
    copy = Candidate(chunk("t#0@v1", "child  one", "other", source="t"))
    other = Candidate(chunk("u#0@v1", "different", "else", source="u"))
    assert [c.chunk.chunk_id for c in dedupe([first, sibling, copy, other])] == ["s#0@v1", "u#0@v1"]


def test_deduped_reads_only_as_far_as_asked_and_matches_dedupe() -> None:
    p = "shared parent section"
    cands = [Candidate(chunk("s#0@v1", "child one", p, source="s")), Candidate(chunk("s#1@v1", "child two", p, source="s")),
             *(Candidate(chunk(f"u{i}", f"text {i}")) for i in range(6))]
    read: list[str] = []

    def tracked() -> object:
        for c in cands:
            read.append(c.chunk.chunk_id)
            yield c

    lazy = Deduped(tracked(), upfront=2)  # type: ignore[arg-type]
    assert [c.chunk.chunk_id for c in lazy.items] == ["s#0@v1", "u0"]
    assert read == ["s#0@v1", "s#1@v1", "u0"] and not lazy.exhausted  # nothing judged past what was asked
    assert [c.chunk.chunk_id for c in lazy.more(3)] == ["u1", "u2", "u3"]
    assert [c.chunk.chunk_id for c in lazy.more(10)] == ["u4", "u5"] and lazy.exhausted
    assert lazy.more(1) == []
    assert lazy.items == dedupe(cands) == Deduped(cands).items  # upfront=None: all of it
    assert Deduped(cands).exhausted and Deduped(cands).more(1) == []


def test_context_budget_cuts_and_flags() -> None:
    cands = [Candidate(chunk(f"c{i}", "x" * 100)) for i in range(5)]
    items, truncated = apply_context_budget(cands, top_k=5, max_chars=250)
    assert [len(i.excerpt) for i in items] == [100, 100, 50]
    assert truncated
    items, truncated = apply_context_budget(cands, top_k=2, max_chars=10_000)
    assert len(items) == 2 and not truncated  # top_k is the caller's choice, not a cut
    items, truncated = apply_context_budget(cands[:2], top_k=2, max_chars=10_000)
    assert len(items) == 2 and not truncated


def test_fusion_settings_follow_the_query_language() -> None:
    from service.config import Config
    from service.pipeline.fusion import FusionParams, fusion_for

    import dataclasses

    for cfg in (dataclasses.replace(Config(), latin_embedding_model=""),
                dataclasses.replace(Config(), latin_embedding_model="some-latin-model")):
        assert fusion_for("如何开具发票 invoice", cfg) == FusionParams(cfg.cjk_rrf_k, cfg.cjk_bm25_weight, cfg.cjk_knn_weight)
    off, on = dataclasses.replace(cfg, latin_embedding_model=""), cfg
    assert fusion_for("how do I get an invoice", off) == FusionParams(off.rrf_k, off.bm25_weight, off.knn_weight)
    # Three legs where the Latin-script leg is served: their own settings.
    assert fusion_for("how do I get an invoice", on) == FusionParams(
        on.latin_leg_rrf_k, on.latin_leg_bm25_weight, on.latin_leg_knn_weight, on.latin_knn_weight)
    # Served but not run for this request (not asked for, or the store still catching up):
    # the two legs fuse exactly as without it.
    assert fusion_for("how do I get an invoice", on, latin=False) == fusion_for("how do I get an invoice", off)


def test_interpolate_minmax_both_scores() -> None:
    from service.pipeline.fusion import interpolate, minmax

    assert minmax([2.0, 4.0, 3.0]) == [0.0, 1.0, 0.5]
    assert minmax([1.0, 1.0]) == [0.0, 0.0]
    rerank, fused = [10.0, 12.0, 11.0], [0.3, 0.1, 0.2]
    assert interpolate(rerank, fused, 1.0) == [0.0, 1.0, 0.5]
    assert interpolate(rerank, fused, 0.0) == pytest.approx([1.0, 0.0, 0.5])
    mixed = interpolate(rerank, fused, 0.6)
    assert mixed == pytest.approx([0.4, 0.6, 0.5])
