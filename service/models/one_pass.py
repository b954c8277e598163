"""A chunk's vector and its reranker passage states from one model pass (ingest).

The split reranker's lower layers are the embedder's first layers, frozen (README "Cached
passage states"). So when a chunk's embedder input is, token for token, the row a rerank
reads (the passage fits the passage cap; both read title, breadcrumb and text), the
embedder's hidden states after those layers are the chunk's passage states: the same
weights in another int8 rendering (fused attention, QKV quantised together). Ingest then
taps them from the embedding pass instead of running the lower layers a second time. A
chunk whose rows differ gets the lower graph's states as before: past the cap the
embedder's states have seen tokens the rerank row cuts off (logits moved by ~0.3 on such
passages, several times the noise). With ``second_pass=False`` such a chunk gets no states
at ingest: its first rerank computes them (and write-back keeps them), so only chunks that
reach a rerank head pay for that pass (``rerank_states_second_pass``).

The embedding calls are the ones ingest makes without states (a document's chunks
together, padded as ``tokenize`` pads them), so every vector is the one ingest without
states stores, bit for bit, and turning states on changes no first-stage answer. A tapped
chunk's states then carry that call's int8 activation scale, as the one graph's logits
carry their batch's: deterministic for a document version, within the int8 noise of the
lower graph's own states.

The pairing is taken only when a probe agrees: both tokenizers give the same rows and the
tapped states match the lower graph's token by token (cosine >= ``MIN_TOKEN_COSINE``). An
embedder whose layers the reranker was not trained on (another model, a domain-adapted one)
fails it and ingest keeps the two passes.
"""

from __future__ import annotations

import time

import numpy as np

from service.models.base import Encoded, FloatArray
from service.models.onnx_cross_encoder import OnnxCrossEncoder
from service.models.onnx_embedder import OnnxEmbedder

# Short passages of either script (each within any passage cap), with and without a title line.
PROBES = (
    "Billing\nTo get a refund for an invoice, open Billing, choose the invoice and press Request refund.",
    "如何重置密码：打开设置页面，点击安全，然后选择重置密码。",
)
# Token-wise cosine of the tapped states against the lower graph's, worst token, one passage
# a call (the probe). Measured on 100 valid InsuranceQA answers per language within the cap
# (e5-small int8 against the shipped reranker's lower graph): worst token 0.977 en / 0.979 zh,
# median 0.998 / 1.000; logits over them moved by mean |d| 0.047 / 0.034 (the int8 noise
# between the one graph and the two is ~0.18). A reranker whose lower layers are not the
# embedder's scores far below.
MIN_TOKEN_COSINE = 0.95


def token_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Worst token's cosine between two [tokens, hidden] arrays of the same shape."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.min(np.sum(a * b, axis=1) / np.maximum(norms, 1e-12)))


class OnePassStates:
    """``PassagesWithStates`` for an ONNX embedder and the split reranker built on it."""

    def __init__(self, embedder: OnnxEmbedder, reranker: OnnxCrossEncoder, *, second_pass: bool = True) -> None:
        if reranker.states_key is None:
            raise ValueError(f"{reranker.info.model_id} keeps no passage states")
        self._embedder, self._reranker = embedder, reranker
        self.states_key: str = reranker.states_key
        self.second_pass = second_pass

    @classmethod
    def pair(cls, embedder: object, reranker: object, *, second_pass: bool = True) -> tuple[OnePassStates | None, str]:
        """The pairing, or None and why not (the probe; module doc)."""
        if not isinstance(embedder, OnnxEmbedder) or not isinstance(reranker, OnnxCrossEncoder):
            return None, "not an ONNX embedder and split reranker"
        layers = reranker.lower_layers
        if layers == 0:
            return None, f"{reranker.info.model_id} keeps no passage states"
        if not embedder.tap_hidden_states(layers):
            return None, f"{embedder.info.model_id} has no output after layer {layers}"
        one = cls(embedder, reranker, second_pass=second_pass)
        why = one.probe()
        return (None, why) if why else (one, "")

    def probe(self) -> str:
        """'' when the tapped states are the reranker's (module doc), else why not."""
        for text in PROBES:
            _, hidden, ids = self._tapped([text])
            row = self._reranker.passage_rows([text])[0]
            if ids[0] != row:
                return "the embedder and the reranker tokenize a probe passage differently"
            tapped, lower = hidden[0][: len(row)], self._reranker.lower_states([row])[0]
            cosine = token_cosine(tapped, lower) if tapped.shape == lower.shape else -1.0
            if cosine < MIN_TOKEN_COSINE:
                return (f"{self._embedder.info.model_id}'s first {self._reranker.lower_layers} layers are not "
                        f"{self._reranker.info.model_id}'s lower layers (worst token cosine {cosine:.3f} on a probe)")
        return ""

    def _tapped(self, texts: list[str]) -> tuple[FloatArray, FloatArray, list[list[int]]]:
        return self._infer(self._embedder.tokenize(texts, "passage"))

    def _infer(self, encoded: Encoded) -> tuple[FloatArray, FloatArray, list[list[int]]]:
        vectors, hidden = self._embedder.infer_with_hidden(encoded)
        ids = [[int(t) for t in row[: int(n)]] for row, n in zip(encoded.input_ids, encoded.attention_mask.sum(axis=1))]
        return vectors, hidden, ids

    def embed_with_states(
        self, texts: list[str]
    ) -> tuple[list[tuple[FloatArray, bytes | None, bool]], float, float]:
        """One call over the chunk texts, as ingest without states makes it (the runtime
        hands over a document's chunks as that path does); then the lower graph, one row per
        call, for the chunks whose rows differ (None for them without ``second_pass``)."""
        t0 = time.perf_counter()
        rows = self._reranker.passage_rows(texts)
        encoded = self._embedder.tokenize(texts, "passage")
        t1 = time.perf_counter()
        vectors, hidden, ids = self._infer(encoded)
        out: list[tuple[FloatArray, bytes | None, bool]] = []
        for i, row in enumerate(rows):
            if ids[i] == row:
                out.append((vectors[i], self._reranker.encode_states(hidden[i][: len(row)]), True))
            elif self.second_pass:
                out.append((vectors[i], self._reranker.encode_states(self._reranker.lower_states([row])[0]), False))
            else:
                out.append((vectors[i], None, False))
        return out, t1 - t0, time.perf_counter() - t1
