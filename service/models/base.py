"""Model backends, split Infinity-style into pre-processing (tokenize), core inference and
post-processing. Backends are synchronous and CPU-bound: they only ever run inside the
executor pool (``service.models.runtime``), never on the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

TextKind = Literal["query", "passage"]
FloatArray = npt.NDArray[np.float32]


def pad_rows(rows: Sequence[Sequence[int] | npt.NDArray[np.int64]], pad_id: int,
             multiple: int = 1) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Token id rows as int64 [n, width] ids and attention mask; width = the longest row,
    rounded up to ``multiple``. Numpy only: the training path uses it too."""
    width = max((len(r) for r in rows), default=0)
    width += -width % multiple
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def pad_states(arrays: Sequence[npt.NDArray[Any]], hidden: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Per-row hidden states ([tokens, hidden] each) as float32 [n, width, hidden] and the
    int64 attention mask, width = the longest row: the split reranker's joint-graph feeds."""
    width = max((a.shape[0] for a in arrays), default=0)
    x = np.zeros((len(arrays), width, hidden), np.float32)
    mask = np.zeros((len(arrays), width), np.int64)
    for i, a in enumerate(arrays):
        x[i, : a.shape[0]] = a
        mask[i, : a.shape[0]] = 1
    return x, mask


@dataclass
class Encoded:
    """Tokenizer output for one batch, ready for ``infer``."""

    input_ids: npt.NDArray[np.int64]
    attention_mask: npt.NDArray[np.int64]
    token_type_ids: npt.NDArray[np.int64] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ModelInfo:
    """What an attempt records about the model that served it."""

    model_id: str  # e.g. "multilingual-e5-small-int8"
    kind: str  # "embedding" | "cross-encoder" | "dummy"
    sha256: str  # hash of the ONNX file (or a fixed id for dummy models)
    dimension: int | None = None
    max_length: int = 0


class EmbeddingBackend(abc.ABC):
    info: ModelInfo
    # False when one input's output depends on the other inputs of its batch (per-tensor
    # dynamic int8 activation quantization takes its range over the whole batch): the
    # runtime then never runs two requests' items in one inference call.
    batch_invariant: bool = True

    @property
    def dimension(self) -> int:
        assert self.info.dimension is not None
        return self.info.dimension

    @abc.abstractmethod
    def tokenize(self, texts: list[str], kind: TextKind) -> Encoded:
        """Pre-processing: prefixes, truncation, padding."""

    @abc.abstractmethod
    def infer(self, encoded: Encoded) -> FloatArray:
        """Core inference + post-processing: returns [n, dim] float32, L2-normalised."""


class CrossEncoderBackend(abc.ABC):
    info: ModelInfo
    batch_invariant: bool = True  # as EmbeddingBackend.batch_invariant
    # Cached passage states (service/models/passage_states.py): the key stored states must
    # carry to be used by this model; None = this model cannot use stored states.
    states_key: str | None = None
    # How pairs are scored: "joint" (query and passage through the model together) or
    # "towers" (each side alone, then a dot product; service/models/towers.py).
    scoring: str = "joint"

    def passage_states(self, passages: list[str]) -> list[bytes]:
        """Encoded passage states for ``states_key`` (only models that have one)."""
        raise NotImplementedError(f"{self.info.model_id} has no cached passage states")

    def tokenize_with_states(self, pairs: list[tuple[str, str]], states: Sequence[bytes | None]) -> Encoded:
        """Like ``tokenize``; a model with a ``states_key`` skips the passages whose stored
        states are given (row-aligned with ``pairs``) and ``infer`` reuses those states."""
        return self.tokenize(pairs)

    @abc.abstractmethod
    def tokenize(self, pairs: list[tuple[str, str]]) -> Encoded:
        """Pairs as ``[CLS] query [SEP] passage [SEP]`` (truncating the passage first)."""

    @abc.abstractmethod
    def infer(self, encoded: Encoded) -> FloatArray:
        """One relevance logit per pair: shape [n]."""


class PassagesWithStates(Protocol):
    """Ingest's passage vectors and reranker passage states together (``one_pass.py``):
    from one model pass where the embedder's pass is the reranker's lower layers."""

    states_key: str

    def embed_with_states(
        self, texts: list[str]
    ) -> tuple[list[tuple[FloatArray, bytes | None, bool]], float, float]:
        """Chunk texts (what the embedder embeds and a rerank reads) -> per chunk (vector,
        stored-states blob or None where it is left to the chunk's first rerank, whether one
        pass gave both), tokenize seconds, inference seconds."""
        ...
