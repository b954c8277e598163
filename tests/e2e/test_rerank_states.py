"""Cached passage states end to end, through real gRPC with the shipped split reranker: an
ingest stores each chunk's states (from its embedding pass where it can), a reranked query reuses them and orders its evidence as
recomputing every passage does, and a restart keeps them (README "Cached passage states")."""

from __future__ import annotations

import pytest

from service._gen.retrieval.v1 import corpus_pb2, retrieval_pb2, types_pb2
from service.app import DEFAULT_RERANKER
from service.engines.base import Engine, make_chunk_id
from service.engines.embedded import EmbeddedEngine
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.offline.builder import default_models_dir
from tests.support.harness import StartServer, evidence_of, fill_caught_up, passages_computed, result_of

pytestmark = pytest.mark.slow

RERANKER = DEFAULT_RERANKER  # the default pair's reranker
# Logits. Measured on these queries: largest move 0.36, largest swap 0.42 (the continued
# reranker); 0.60 and 0.25 (the towers reranker of 2026-12-07, whose rerank_drift.py max |d|
# against the one graph is 0.68 en / 0.90 zh: int8 activation scales taken per call). A
# wrong passage's vector moves a logit by several.
NOISE = 0.75
PLAIN = ["Term life insurance pays a benefit if you die during the term.", "定期寿险在保险期间内身故时给付保险金。"]
# One chunk (333 characters, 232 tokens): past the passage cap (192, the trained cap and the default),
# the embedding pass reads further than a rerank row, so its states take the lower graph.
LONG_ZH = ("长期护理保险在被保险人因疾病或意外需要长期护理时按合同约定给付护理保险金，等待期为九十天。"
           "保单的现金价值可以用于申请保单贷款，贷款利率按年计算，逾期未还将影响保障。"
           "如需理赔，请准备身份证明、医疗诊断证明、护理评估报告以及银行账户信息，并在事故发生后三十日内提交。"
           "本保险不承担战争、核辐射、酒后驾驶以及故意自伤导致的护理费用。续保时保险费率可能根据年龄调整。"
           "投保人可以在犹豫期内无条件解除合同并退还全部保险费，犹豫期过后解除合同只退还现金价值。"
           "护理保险金按月给付，最长给付期间为十年，被保险人身故后停止给付。"
           "被保险人在合同有效期内确诊阿尔茨海默病或帕金森病并经评估需要护理的，也属于保障范围。"
           "保险公司会在收到完整理赔材料后十个工作日内作出核定，并通知受益人领取保险金。")
QUERIES = ["reset password", "how do I get a refund for an invoice", "orion-pager escalation", "如何重置密码"]


@pytest.fixture(scope="module")
def reranker() -> OnnxCrossEncoder:
    model_dir = default_models_dir() / RERANKER
    if not (model_dir / "lower.onnx").is_file():
        pytest.skip(f"{model_dir} has no two-graph layout: run `make models`")
    return OnnxCrossEncoder(model_dir)


async def _stored(engine: Engine, key: str) -> int:
    chunks = await engine.get_chunks([c for c in await _chunk_ids(engine)])
    found = await engine.passage_states([(c.chunk_id, c.content_hash) for c in chunks], key)
    return len(found)


async def _chunk_ids(engine: Engine) -> list[str]:
    from service.engines.base import SearchFilter

    hits = (await engine.bm25("password invoice refund escalation 密码", 200, SearchFilter(acl_groups=None), 5.0)).hits
    return [h.chunk.chunk_id for h in hits]


async def test_stored_states_rerank_like_recomputation(start_server: StartServer, reranker: OnnxCrossEncoder,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One server, one index: each query once over the stored states, once with the engine
    made to hand out none (every passage recomputed by the one graph). The same items; scores and order may move only by the model's own noise: its int8 activations
    are quantised with one scale per batch, so the one graph alone moves a logit by up to
    ~0.5 with its batch company, and even fp16 states move one by ~0.09 (README)."""
    assert reranker.states_key is not None
    live = await start_server(reranker=reranker, rerank_states=True, rerank_states_second_pass=True)
    engine = live.app.engine
    assert await _stored(engine, reranker.states_key) > 0
    # Ingest takes a chunk's states from its embedding pass when the embedder read exactly
    # the rerank's row (service/models/one_pass.py): every demo chunk (title, breadcrumb and
    # text are read by both, within the cap), and not a chunk past the passage cap, which
    # takes the second pass here (on, so that every passage this test reranks is stored).
    from tests.support.scrape import parse

    assert live.app.runtime.one_pass_states
    passes = {"one": 0.0, "two": 0.0}

    def count() -> dict[str, float]:
        scraped = parse(live.app.metrics.exposition().decode())
        return {p: scraped.get(("retrieval_ingest_passage_states_total", (("pass", p),)), 0.0) - passes[p]
                for p in passes}

    passes = count()
    assert passes["two"] == 0 and passes["one"] == await _stored_anywhere(engine, reranker.states_key) > 0
    plain = [corpus_pb2.Document(source_id=f"plain-{i}", version="v1", text=text, collection=types_pb2.COLLECTION_DOC)
             for i, text in enumerate([*PLAIN, LONG_ZH])]
    await live.ingest(plain)
    assert count() == {"one": len(PLAIN), "two": 1}
    found = await engine.passage_states([(c.chunk_id, c.content_hash) for c in await engine.get_chunks(
        [make_chunk_id(d.source_id, 0, d.version) for d in plain])], reranker.states_key)
    assert len(found) == len(plain)
    ask = dict(top_k=8, options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    stored = {q: evidence_of(await live.retrieve(query=q, **ask)) for q in QUERIES}  # type: ignore[arg-type]

    async def none_stored(chunks: object, key: str) -> dict[str, bytes]:
        return {}

    monkeypatch.setattr(engine, "passage_states", none_stored)
    for query in QUERIES:
        recomputed = evidence_of(await live.retrieve(query=query, **ask))  # type: ignore[arg-type]
        score = {e.evidence_id: e.rerank_score for e in recomputed}
        got = [e.evidence_id for e in stored[query]]
        both = [a for a in got if a in score]  # the 8th place may differ (noise at the cut)
        assert len(both) >= len(got) - 2, query
        for e in stored[query]:
            if e.evidence_id in score:
                assert abs(e.rerank_score - score[e.evidence_id]) < NOISE, (query, e.evidence_id)
        for i, a in enumerate(both):  # a before b over stored states: b not clearly better
            for b in both[i + 1:]:
                assert score[b] - score[a] < NOISE, (query, a, b, score[a], score[b])


async def test_states_survive_a_restart(start_server: StartServer, reranker: OnnxCrossEncoder) -> None:
    assert reranker.states_key is not None
    first = await start_server(reranker=reranker, rerank_states=True)
    before = await _stored(first.app.engine, reranker.states_key)
    assert before > 0
    await first.app.engine.close()  # what a stop does to the store
    again = EmbeddedEngine(first.app.cfg.data_dir / "engine")  # what the next start opens
    await again.start()
    try:
        assert await _stored(again, reranker.states_key) == before
    finally:
        await again.close()


async def _stored_anywhere(engine: Engine, key: str) -> int:
    """Stored states over every chunk of the demo corpus (not only those a BM25 query finds)."""
    from service.demo.corpus import DEMO_DOCUMENTS
    from service.engines.base import make_chunk_id

    ids = [make_chunk_id(d["source_id"], i, d["version"]) for d in DEMO_DOCUMENTS for i in range(64)]
    chunks = await engine.get_chunks(ids)
    return len(await engine.passage_states([(c.chunk_id, c.content_hash) for c in chunks], key))


async def test_one_pass_only_leaves_the_rest_to_the_first_rerank(start_server: StartServer,
                                                                  reranker: OnnxCrossEncoder) -> None:
    """The default with ``rerank_states`` (``rerank_states_second_pass`` off): ingest stores
    the states its embedding pass gives (the demo's chunks, plain ones) and none for a chunk
    past the passage cap; a rerank computes those, write-back (on beside states at ingest)
    keeps them, and what it keeps are the very bytes a second pass at ingest stores."""
    from tests.support.scrape import parse

    assert reranker.states_key is not None
    # The fill off: it would compute the long chunk's states once ingest is quiet (below).
    live = await start_server(reranker=reranker, rerank_states=True, rerank_states_fill=False)
    engine = live.app.engine
    assert not live.app.cfg.rerank_states_second_pass, "the default leaves chunks past the cap to their first rerank"
    assert live.app.runtime.one_pass_states and live.app.cfg.states_write_back

    def passes() -> dict[str, float]:
        scraped = parse(live.app.metrics.exposition().decode())
        return {p: scraped.get(("retrieval_ingest_passage_states_total", (("pass", p),)), 0.0)
                for p in ("one", "two", "left")}

    demo = passes()
    assert demo["one"] == await _stored_anywhere(engine, reranker.states_key) > 0 and demo["left"] == demo["two"] == 0
    plain = [corpus_pb2.Document(source_id=f"plain-{i}", version="v1", text=text, collection=types_pb2.COLLECTION_DOC)
             for i, text in enumerate([*PLAIN, LONG_ZH])]
    await live.ingest(plain)
    after = passes()
    assert {p: after[p] - demo[p] for p in after} == {"one": len(PLAIN), "two": 0, "left": 1}

    async def stored_for(docs: list[corpus_pb2.Document]) -> dict[str, bytes]:
        chunks = await engine.get_chunks([make_chunk_id(d.source_id, 0, d.version) for d in docs])
        return await engine.passage_states([(c.chunk_id, c.content_hash) for c in chunks], reranker.states_key)

    assert len(await stored_for(plain[:-1])) == len(PLAIN), "plain chunks take their states from the embedding pass"
    assert await stored_for(plain[-1:]) == {}, "past the cap: left to its first rerank"
    reply = await live.retrieve(query="长期护理保险的等待期和给付期间", top_k=8,
                                options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    assert "plain-2" in {e.source_id for e in evidence_of(reply)}
    await live.app.runner.rerank.states_write_back.drain()
    written = await stored_for(plain[-1:])
    assert len(written) == 1, "its first rerank computed them and write-back kept them"

    # Parity: a server that takes the second pass at ingest stores the same bytes for it,
    # so leaving it to the first rerank changes no score, only when the vector is computed.
    second = await start_server(reranker=reranker, rerank_states=True, rerank_states_second_pass=True, demo=False)
    await second.ingest(plain)
    chunk = (await second.app.engine.get_chunks([make_chunk_id(plain[-1].source_id, 0, plain[-1].version)]))[0]
    assert chunk.content_hash == (await engine.get_chunks([chunk.chunk_id]))[0].content_hash
    assert await second.app.engine.passage_states([(chunk.chunk_id, chunk.content_hash)], reranker.states_key) == written


async def test_the_fill_computes_what_ingest_left_before_a_rerank_has_to(
        start_server: StartServer, reranker: OnnxCrossEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default with ``rerank_states``: the chunk past the cap that ingest left gets its
    states from the fill once ingest is quiet (``ingest/states_fill.py``), the bytes its
    first rerank would have computed, so that rerank computes nothing."""
    assert reranker.states_key is not None
    live = await start_server(reranker=reranker, rerank_states=True, rerank_states_fill_idle_s=0.2)
    engine, fill = live.app.engine, live.app.ingestor.states_fill
    assert live.app.cfg.rerank_states_fill and fill is not None
    long_doc = corpus_pb2.Document(source_id="long-zh", version="v1", text=LONG_ZH, collection=types_pb2.COLLECTION_DOC)
    await live.ingest([long_doc])
    await fill_caught_up(fill, 60)
    [long_chunk] = await engine.get_chunks([make_chunk_id("long-zh", 0, "v1")])
    assert await engine.passage_states([(long_chunk.chunk_id, long_chunk.content_hash)], reranker.states_key) == {
        long_chunk.chunk_id: reranker.passage_states([long_chunk.search_text])[0]}
    assert await engine.chunks_without_states(reranker.states_key, "", 1000) == ([], None)
    assert fill.progress.written == 1, "the demo's chunks had theirs from ingest"

    left = passages_computed(monkeypatch, live.app)
    reply = await live.retrieve(query="长期护理保险的等待期和给付期间", top_k=8,
                                options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    assert "long-zh" in {e.source_id for e in evidence_of(reply)}
    assert left == [0], "the first rerank read every passage's states"


async def test_write_back_stores_what_a_rerank_computed(start_server: StartServer, reranker: OnnxCrossEncoder,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Write-back only: ingest stores nothing; the first rerank of a query computes its
    head's states and stores them; the same query again reads them (nothing left to
    compute) and gets exactly the same scores: a passage's states depend on its text alone,
    so the stored bytes are the ones the first rerank computed and used."""
    assert reranker.states_key is not None
    live = await start_server(reranker=reranker, rerank_states=False, rerank_states_write_back=True)
    engine, runner = live.app.engine, live.app.runner
    assert await _stored_anywhere(engine, reranker.states_key) == 0, "ingest computes no states in write-back mode"
    ask = dict(top_k=8, options=retrieval_pb2.RetrievalOptions(min_quality=1e-9))
    first = evidence_of(await live.retrieve(query=QUERIES[0], **ask))  # type: ignore[arg-type]
    await runner.rerank.states_write_back.drain()
    stored = await _stored_anywhere(engine, reranker.states_key)
    assert 0 < stored <= live.app.cfg.rerank_top_n and runner.rerank.states_write_back.written == stored
    from tests.support.scrape import parse

    scraped = parse(live.app.metrics.exposition().decode())
    assert scraped[("retrieval_passage_states_write_back_total", (("result", "written"),))] == stored

    seen = passages_computed(monkeypatch, live.app)
    again = evidence_of(await live.retrieve(query=QUERIES[0], **ask))  # type: ignore[arg-type]
    assert seen == [0], "the second rerank of the same head reads every passage's states"
    score = {e.evidence_id: e.rerank_score for e in first}
    assert {e.evidence_id for e in again} == set(score)
    assert [(e.evidence_id, e.rerank_score) for e in again] == [(e.evidence_id, e.rerank_score) for e in first]
    await runner.rerank.states_write_back.drain()
    assert runner.rerank.states_write_back.written == stored, "nothing new was computed, so nothing written"
