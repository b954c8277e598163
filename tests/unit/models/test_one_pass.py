"""One pass at ingest (service/models/one_pass.py): the shipped embedder, tapped after the
split reranker's lower layers, gives each chunk its vector unchanged and, where its input is
the rerank's passage row, passage states that rerank like the lower graph's; other chunks
get the lower graph's own states; a reranker not built on the embedder is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.models.manifest import TOKENIZER_FILE
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.models.onnx_embedder import OnnxEmbedder
from service.models.one_pass import MIN_TOKEN_COSINE, OnePassStates, token_cosine
from service.models.passage_states import rerank_passage_text
from service.offline.builder.tiny_cross_encoder import build_tiny_split_cross_encoder

pytestmark = pytest.mark.slow

SHORT = [
    "Term life insurance pays a benefit if you die during the term.",
    "Car insurance covers damage to your vehicle, and sometimes to the other driver's.",
    "申请理赔时需要提交发票和诊断证明。",
]
LONG = "a much longer passage about annuities and riders " * 30  # past the 128-token cap
QUERY = "what is term life insurance"


@pytest.fixture(scope="module")
def shipped(models_dir: Path) -> tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]:
    embedder = OnnxEmbedder(models_dir / "multilingual-e5-small-int8")
    reranker = OnnxCrossEncoder(models_dir / "e5-small-split-reranker-int8", passage_tokens=128)
    one_pass, why = OnePassStates.pair(embedder, reranker)
    assert one_pass is not None, why
    return embedder, reranker, one_pass


def test_tapping_changes_no_vector(models_dir: Path, shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]
                                   ) -> None:
    """Same session, one more output: the vectors are the untapped graph's, bit for bit."""
    tapped = shipped[0]
    plain = OnnxEmbedder(models_dir / "multilingual-e5-small-int8")
    for text in [*SHORT, LONG]:
        before = plain.infer(plain.tokenize([text], "passage"))[0]
        assert np.array_equal(tapped.infer(tapped.tokenize([text], "passage"))[0], before)
        vector, hidden = tapped.infer_with_hidden(tapped.tokenize_one(text, "passage"))
        assert np.array_equal(vector, before)
        assert hidden.shape == (len(tapped.tokenize_one(text, "passage")), 384)


def test_one_pass_states_rerank_like_the_lower_graphs(
        shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    _, reranker, one_pass = shipped
    passages = [rerank_passage_text("", t) for t in SHORT]
    out, _, _ = one_pass.embed_with_states([(t, p) for t, p in zip(SHORT, passages)])
    assert [single for _, _, single in out] == [True] * len(SHORT)
    tapped = [blob for _, blob, _ in out]
    lower = reranker.passage_states(passages)
    # Another int8 rendering of the same layers: after the codec's own rounding often the
    # very same bytes, and always the same states within the int8 noise.
    for a, b in zip(tapped, lower):
        assert token_cosine(reranker._codec.decode(a), reranker._codec.decode(b)) > MIN_TOKEN_COSINE
    pairs = [(QUERY, p) for p in passages]
    got = reranker.infer(reranker.tokenize_with_states(pairs, tapped))
    want = reranker.infer(reranker.tokenize_with_states(pairs, lower))
    # Measured on 600+ valid pairs per language within the cap: mean |d| 0.047 / 0.034.
    assert np.abs(got - want).max() < 0.25, (got, want)


def test_rows_that_differ_take_the_lower_graph(shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    """Past the cap (the embedder reads further) or with a breadcrumb (the rerank does not
    read it): the lower graph's own states, the same bytes as a rerank would compute."""
    embedder, reranker, one_pass = shipped
    items = [(LONG, rerank_passage_text("", LONG)),
             ("Title\nPolicies > Life\n" + SHORT[0], rerank_passage_text("Title", SHORT[0])),
             ("Title\n" + SHORT[0], rerank_passage_text("Title", SHORT[0]))]  # a title line alone: one pass
    out, _, _ = one_pass.embed_with_states(items)
    assert [single for _, _, single in out] == [False, False, True]
    assert [blob for _, blob, _ in out[:2]] == reranker.passage_states([p for _, p in items[:2]])
    for (vector, _, _), (text, _) in zip(out, items):
        assert np.array_equal(vector, embedder.infer(embedder.tokenize([text], "passage"))[0])


def test_a_chunks_states_do_not_depend_on_its_company(
        shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    _, _, one_pass = shipped
    items = [(t, rerank_passage_text("", t)) for t in [*SHORT, LONG]]
    together, _, _ = one_pass.embed_with_states(items)
    for item, (vector, blob, _) in zip(items, together):
        (alone_vector, alone_blob, _), = one_pass.embed_with_states([item])[0]
        assert alone_blob == blob and np.array_equal(alone_vector, vector)


def test_a_reranker_not_built_on_the_embedder_is_refused(tmp_path: Path, models_dir: Path, e5_fp32_dir: Path) -> None:
    """Random lower layers (same tokenizer): the probe sees they are not the embedder's."""
    tiny = OnnxCrossEncoder(build_tiny_split_cross_encoder(tmp_path, e5_fp32_dir / TOKENIZER_FILE, lower=1, upper=1,
                                                           cross_bias=0.0))
    embedder = OnnxEmbedder(models_dir / "multilingual-e5-small-int8")
    one_pass, why = OnePassStates.pair(embedder, tiny)
    assert one_pass is None and "lower layers" in why
    one_pass, why = OnePassStates.pair(object(), tiny)
    assert one_pass is None and "ONNX" in why
