"""Sentence embeddings from a built model dir (see ``service.offline.builder``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.models._ort import batch_invariant, load_tokenizer, make_session, pad_batch
from service.models.base import EmbeddingBackend, Encoded, FloatArray, ModelInfo, TextKind
from service.models.manifest import MODEL_FILE, TOKENIZER_FILE, read_manifest

# Serving default: e5 was trained at 512, but 256 covers our passages and halves the
# attention cost of the rare long one.
DEFAULT_MAX_LENGTH = 256


class OnnxEmbedder(EmbeddingBackend):
    """Prefix + tokenize (pad to the longest in the batch), then one onnxruntime run whose
    graph already does mean pooling and L2 normalisation.

    Thread-safe: share one instance across the executor threads rather than loading one
    per thread (the 250k-piece unigram tokenizer alone takes ~290 MB)."""

    def __init__(self, model_dir: Path, threads: int = 1, max_length: int = DEFAULT_MAX_LENGTH) -> None:
        manifest = read_manifest(model_dir, "embedding")
        self.max_length = min(max_length, int(manifest["max_length"]))
        self.prefixes: dict[TextKind, str] = {"query": manifest["query_prefix"], "passage": manifest["passage_prefix"]}
        self._output = str(manifest["output"])
        self.info = ModelInfo(
            model_id=str(manifest["model_id"]),
            kind="embedding",
            sha256=str(manifest["onnx_sha256"]),
            dimension=int(manifest["dimension"]),
            max_length=self.max_length,
        )
        self._tokenizer, self._pad_id = load_tokenizer(model_dir / TOKENIZER_FILE)
        self._tokenizer.enable_truncation(max_length=self.max_length)
        self._session = make_session(model_dir / MODEL_FILE, threads)
        self.batch_invariant = batch_invariant(model_dir / MODEL_FILE)

    def tokenize(self, texts: list[str], kind: TextKind) -> Encoded:
        prefix = self.prefixes[kind]
        ids, mask, _ = pad_batch(self._tokenizer.encode_batch([prefix + t for t in texts]), self._pad_id)
        return Encoded(input_ids=ids, attention_mask=mask)

    def infer(self, encoded: Encoded) -> FloatArray:
        if encoded.batch_size == 0:
            return np.zeros((0, self.dimension), dtype=np.float32)
        feeds = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask}
        out = self._session.run([self._output], feeds)[0]
        return np.ascontiguousarray(out, dtype=np.float32)


def load_embedder(model_dir: Path, threads: int = 1, max_length: int = DEFAULT_MAX_LENGTH) -> OnnxEmbedder:
    return OnnxEmbedder(model_dir, threads=threads, max_length=max_length)
