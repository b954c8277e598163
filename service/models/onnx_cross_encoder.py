"""Cross-encoder reranking from a built model dir (``kind: cross-encoder``).

Two layouts, told apart by the manifest's ``architecture``:

- ``joint`` (default): one sequence ``<s> q </s></s> p </s>`` through every layer;
- ``split``: the trained reranker (``builder/split_graph.py``): the query ``<s> query: q </s>``
  and the passage ``<s> passage: p </s>`` are separate inputs; the graph runs the lower
  layers on each and the upper layers on both together.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.models._ort import batch_invariant, load_tokenizer, make_session, pad_batch
from service.models.base import CrossEncoderBackend, Encoded, FloatArray, ModelInfo, pad_rows
from service.models.manifest import MODEL_FILE, TOKENIZER_FILE, read_manifest


class OnnxCrossEncoder(CrossEncoderBackend):
    """Pairs go through the tokenizer's pair template (``[CLS] q [SEP] p [SEP]``).
    Truncation is "only second" done by hand: the query is clipped to half the budget and
    the passage gets the rest, so a pair's tokens never depend on the other pairs in its
    batch and a long query cannot make the pair untruncatable. Thread-safe, like
    ``OnnxEmbedder``."""

    def __init__(self, model_dir: Path, threads: int = 1, max_length: int | None = None) -> None:
        manifest = read_manifest(model_dir, "cross-encoder")
        limit = int(manifest["max_length"])
        self.max_length = min(max_length or limit, limit)
        self.max_query_tokens = self.max_length // 2
        self.info = ModelInfo(
            model_id=str(manifest["model_id"]),
            kind="cross-encoder",
            sha256=str(manifest["onnx_sha256"]),
            max_length=self.max_length,
        )
        self._tokenizer, self._pad_id = load_tokenizer(model_dir / TOKENIZER_FILE)
        self.split = manifest.get("architecture", "joint") == "split"
        if self.split:
            self._split_init(manifest)
        # Tokens left for query + passage once the template's specials are in.
        self._pair_budget = self.max_length - self._tokenizer.num_special_tokens_to_add(True)
        if self._pair_budget - self.max_query_tokens < 1:
            raise ValueError(f"max_length {self.max_length} leaves no room for the passage")
        self._session = make_session(model_dir / MODEL_FILE, threads)
        self.batch_invariant = batch_invariant(model_dir / MODEL_FILE)
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._output = self._session.get_outputs()[0].name

    def _split_init(self, manifest: dict[str, object]) -> None:
        tok = self._tokenizer
        self.max_query_tokens = int(str(manifest["query_max_tokens"]))
        self._passage_max = min(self.max_length, int(str(manifest["passage_max_tokens"])))
        self._query_prefix = tok.encode(str(manifest["query_prefix"]), add_special_tokens=False).ids
        self._passage_prefix = tok.encode(str(manifest["passage_prefix"]), add_special_tokens=False).ids
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        if bos is None or eos is None:
            raise ValueError("split cross-encoder needs <s> and </s> in its tokenizer")
        self._bos, self._eos = int(bos), int(eos)

    def _assemble(self, body: list[int], prefix: list[int], cap: int) -> list[int]:
        # Exactly the trainer's layout (training/split.py ``assemble``).
        return [self._bos, *prefix, *body[: max(0, cap - 2 - len(prefix))], self._eos]

    def _split_tokenize(self, pairs: list[tuple[str, str]]) -> Encoded:
        tok = self._tokenizer
        # One query is usually scored against many passages: tokenize each distinct one once.
        distinct = list(dict.fromkeys(q for q, _ in pairs))
        q_ids = {q: self._assemble(e.ids, self._query_prefix, self.max_query_tokens)
                 for q, e in zip(distinct, tok.encode_batch(distinct, add_special_tokens=False))}
        p_ids = [self._assemble(e.ids, self._passage_prefix, self._passage_max)
                 for e in tok.encode_batch([p for _, p in pairs], add_special_tokens=False)]
        q_rows = [q_ids[q] for q, _ in pairs]
        pid, pmask = pad_rows(p_ids, self._pad_id)
        qid, qmask = pad_rows(q_rows, self._pad_id)
        return Encoded(input_ids=pid, attention_mask=pmask, extra={"query_ids": qid, "query_mask": qmask})

    def tokenize(self, pairs: list[tuple[str, str]]) -> Encoded:
        if self.split:
            return self._split_tokenize(pairs)
        tok = self._tokenizer
        queries = tok.encode_batch([q for q, _ in pairs], add_special_tokens=False)
        passages = tok.encode_batch([p for _, p in pairs], add_special_tokens=False)
        encodings = []
        for q, p in zip(queries, passages):
            q.truncate(self.max_query_tokens)
            p.truncate(self._pair_budget - len(q.ids))
            encodings.append(tok.post_process(q, p, add_special_tokens=True))
        ids, mask, types = pad_batch(encodings, self._pad_id)
        return Encoded(input_ids=ids, attention_mask=mask, token_type_ids=types if "token_type_ids" in self._inputs else None)

    def infer(self, encoded: Encoded) -> FloatArray:
        if encoded.batch_size == 0:
            return np.zeros((0,), dtype=np.float32)
        if self.split:
            feeds = {"query_ids": encoded.extra["query_ids"], "query_mask": encoded.extra["query_mask"],
                     "passage_ids": encoded.input_ids, "passage_mask": encoded.attention_mask}
            out = self._session.run([self._output], feeds)[0]
            return np.asarray(out, dtype=np.float32).reshape(encoded.batch_size)
        feeds = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask}
        if encoded.token_type_ids is not None:
            feeds["token_type_ids"] = encoded.token_type_ids
        out = self._session.run([self._output], feeds)[0]
        return np.asarray(out, dtype=np.float32).reshape(encoded.batch_size)


def load_cross_encoder(model_dir: Path, threads: int = 1, max_length: int | None = None) -> OnnxCrossEncoder:
    return OnnxCrossEncoder(model_dir, threads=threads, max_length=max_length)
