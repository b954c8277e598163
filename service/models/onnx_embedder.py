"""Sentence embeddings from a built model dir (see ``service.offline.builder``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

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
        self._model_file, self._threads = model_dir / MODEL_FILE, threads
        self._session = make_session(self._model_file, threads)
        self.batch_invariant = batch_invariant(self._model_file)
        self._hidden: tuple[int, str] | None = None  # (layers, tensor) once tapped

    def tap_hidden_states(self, layers: int) -> bool:
        """Expose the hidden states after the first ``layers`` transformer layers as a second
        output of the same session (``infer_with_hidden``), so one pass can give a passage's
        vector and a split reranker's passage states (``service/models/one_pass.py``). The
        graph is rewritten in memory only: the file, its sha256 and the vectors stay the
        same (``infer`` asks for the vector alone). False when the graph has no such tensor
        (found as the output of layer ``layers - 1``'s last LayerNorm, by its weight's name,
        fused or not)."""
        if self._hidden is not None:
            return self._hidden[0] == layers
        model = onnx.load(str(self._model_file))
        weight = f"encoder.layer.{layers - 1}.output.LayerNorm.weight"
        tensor = next((n.output[0] for n in model.graph.node if weight in n.input), None)
        if tensor is None or layers < 1:
            return False
        model.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
        self._session = make_session(model.SerializeToString(), self._threads)
        self._hidden = (layers, tensor)
        return True

    def infer_with_hidden(self, encoded: Encoded) -> tuple[FloatArray, FloatArray]:
        """``infer``'s vectors [n, dim] and the tapped hidden states [n, width, hidden] (rows
        padded as ``tokenize`` padded them) from one call."""
        if self._hidden is None:
            raise RuntimeError("no hidden states tapped (tap_hidden_states)")
        feeds = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask}
        vectors, hidden = self._session.run([self._output, self._hidden[1]], feeds)
        return np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(hidden, dtype=np.float32)

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
