"""One pass at ingest (service/models/one_pass.py): the shipped embedder, tapped after the
split reranker's lower layers, gives a document's chunks their vectors unchanged and, where a
chunk's input is the rerank's passage row, passage states that rerank like the lower graph's;
other chunks get the lower graph's own states; a reranker not built on the embedder is refused."""

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
LONG = "a much longer passage about annuities and riders " * 30  # past the passage cap (128 here, 192 trained)
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
    """Same session, one more output, the calls ingest without states makes (a document's
    chunks together): the vectors are the untapped graph's, bit for bit."""
    tapped, _, one_pass = shipped
    plain = OnnxEmbedder(models_dir / "multilingual-e5-small-int8")
    texts = [*SHORT, LONG]
    before = plain.infer(plain.tokenize(texts, "passage"))
    np.testing.assert_array_equal(tapped.infer(tapped.tokenize(texts, "passage")), before)
    vectors, hidden = tapped.infer_with_hidden(tapped.tokenize(texts, "passage"))
    np.testing.assert_array_equal(vectors, before)
    assert hidden.shape[::2] == (len(texts), 384)
    out, _, _ = one_pass.embed_with_states(texts)
    np.testing.assert_array_equal(np.stack([v for v, _, _ in out]), before)


def test_one_pass_states_rerank_like_the_lower_graphs(
        shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    _, reranker, one_pass = shipped
    passages = [rerank_passage_text("", "", t) for t in SHORT]
    out, _, _ = one_pass.embed_with_states(passages)
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
    # The tapped states carry their call's activation scale (here three chunks together),
    # as the one graph's logits carry their batch's. Measured on 648 / 516 valid pairs within
    # the cap, each chunk with 3 random siblings: mean |d| 0.17 / 0.17, max 0.85 / 0.75 (en /
    # zh); alone 0.047 / 0.034. The one graph against the two: mean 0.18, max 1.07 / 0.86.
    assert np.abs(got - want).max() < 1.0, (got, want)


def test_rows_that_differ_take_the_lower_graph(shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    """Past the cap (the embedder reads further): the lower graph's own states, the same
    bytes as a rerank would compute. A title and a breadcrumb are read by both (one layout,
    ``rerank_passage_text``): one pass."""
    embedder, reranker, one_pass = shipped
    texts = [rerank_passage_text("", "", LONG), rerank_passage_text("Title", "Policies > Life", SHORT[0]),
             rerank_passage_text("Title", "", SHORT[0])]
    out, _, _ = one_pass.embed_with_states(texts)
    assert [single for _, _, single in out] == [False, True, True]
    assert [blob for _, blob, _ in out[:1]] == reranker.passage_states(texts[:1])
    np.testing.assert_array_equal(np.stack([v for v, _, _ in out]), embedder.infer(embedder.tokenize(texts, "passage")))


def test_without_a_second_pass_rows_that_differ_are_left_to_the_rerank(
        shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    """``rerank_states_second_pass`` off: the chunks the embedding pass cannot serve get no
    states (their first rerank computes them); the others get the very bytes they get with
    the second pass, and every vector is the same."""
    embedder, reranker, with_second = shipped
    only_one = OnePassStates(embedder, reranker, second_pass=False)
    texts = [rerank_passage_text("", "", LONG), rerank_passage_text("Title", "Policies > Life", SHORT[0]),
             *[rerank_passage_text("", "", t) for t in SHORT]]
    left, _, _ = only_one.embed_with_states(texts)
    full, _, _ = with_second.embed_with_states(texts)
    assert [blob is None for _, blob, _ in left] == [True, False, False, False, False]
    assert [b for _, b, _ in left[1:]] == [b for _, b, _ in full[1:]]
    assert [single for _, _, single in left] == [single for _, _, single in full]
    np.testing.assert_array_equal(np.stack([v for v, _, _ in left]), np.stack([v for v, _, _ in full]))


def test_a_documents_states_are_the_same_bytes_again(
        shipped: tuple[OnnxEmbedder, OnnxCrossEncoder, OnePassStates]) -> None:
    """A tapped chunk's states carry its call's activation scale (its document's chunks):
    the same document gives the same bytes again, and alone its chunk stays within noise."""
    _, reranker, one_pass = shipped
    texts = [rerank_passage_text("", "", t) for t in [*SHORT, LONG]]
    first, _, _ = one_pass.embed_with_states(texts)
    again, _, _ = one_pass.embed_with_states(texts)
    assert [b for _, b, _ in first] == [b for _, b, _ in again]
    (_, alone, _), = one_pass.embed_with_states(texts[:1])[0]
    assert token_cosine(reranker._codec.decode(alone), reranker._codec.decode(first[0][1])) > 0.9


def test_a_reranker_not_built_on_the_embedder_is_refused(tmp_path: Path, models_dir: Path, e5_fp32_dir: Path) -> None:
    """Random lower layers (same tokenizer): the probe sees they are not the embedder's."""
    tiny = OnnxCrossEncoder(build_tiny_split_cross_encoder(tmp_path, e5_fp32_dir / TOKENIZER_FILE, lower=1, upper=1,
                                                           cross_bias=0.0))
    embedder = OnnxEmbedder(models_dir / "multilingual-e5-small-int8")
    one_pass, why = OnePassStates.pair(embedder, tiny)
    assert one_pass is None and "lower layers" in why
    one_pass, why = OnePassStates.pair(object(), tiny)
    assert one_pass is None and "ONNX" in why
