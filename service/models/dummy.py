"""Deterministic stand-in models for tests and the demo: no files, microseconds per text,
yet similar texts get similar vectors and shared terms raise the rerank logit, so
retrieval tests can assert on rankings without loading real weights."""

from __future__ import annotations

import re
import unicodedata
import zlib

import numpy as np
import numpy.typing as npt

from service.models.base import CrossEncoderBackend, EmbeddingBackend, Encoded, FloatArray, ModelInfo, TextKind, pad_rows
from service.script import HAN, HAN_CHARS

_TERM = re.compile(f"[{HAN_CHARS}]|[^\\W_{HAN_CHARS}]+")
_PAD = 0
_SEP = 1


def terms(text: str) -> list[str]:
    """Lower-cased words; every Han character is its own term."""
    return _TERM.findall(unicodedata.normalize("NFKC", text).casefold())


def _hash(feature: str) -> int:
    """Stable across processes (unlike ``hash``); never collides with pad/sep ids."""
    return zlib.crc32(feature.encode("utf-8")) % 0x7FFFFFF0 + 2


def _pad(rows: list[list[int]]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    return pad_rows(rows, _PAD)


class HashEmbedder(EmbeddingBackend):
    """Feature hashing of words, character 3-grams and Han bigrams into 384 signed buckets."""

    def __init__(self, dimension: int = 384, max_length: int = 512) -> None:
        self.info = ModelInfo(
            model_id=f"dummy-hash-{dimension}", kind="dummy", sha256="dummy-hash-v1", dimension=dimension, max_length=max_length
        )

    def _features(self, text: str) -> list[str]:
        words = terms(text)
        feats = list(words)
        for w in words:
            if len(w) > 2:
                padded = f"#{w}#"
                feats += [padded[i : i + 3] for i in range(len(padded) - 2)]
        feats += [a + b for a, b in zip(words, words[1:]) if HAN.fullmatch(a) and HAN.fullmatch(b)]
        return feats[: self.info.max_length]

    def tokenize(self, texts: list[str], kind: TextKind) -> Encoded:
        # ``kind`` is ignored on purpose: a query and a passage with the same text must
        # embed identically for the dummy to be predictable in tests.
        ids, mask = _pad([[_hash(f) for f in self._features(t)] for t in texts])
        return Encoded(input_ids=ids, attention_mask=mask)

    def infer(self, encoded: Encoded) -> FloatArray:
        dim = self.dimension
        out = np.zeros((encoded.batch_size, dim), dtype=np.float32)
        rows, cols = np.nonzero(encoded.attention_mask)
        ids = encoded.input_ids[rows, cols]
        signs = np.where((ids >> 16) & 1, 1.0, -1.0).astype(np.float32)
        np.add.at(out, (rows, ids % dim), signs)
        norms = np.linalg.norm(out, axis=1)
        out[norms == 0, 0] = 1.0  # empty text: any fixed unit vector
        norms[norms == 0] = 1.0
        out /= norms[:, None]
        return out


class OverlapCrossEncoder(CrossEncoderBackend):
    """Logit = 10 * (share of distinct query terms found in the passage) - 5."""

    def __init__(self, max_length: int = 512) -> None:
        self.info = ModelInfo(model_id="dummy-overlap", kind="dummy", sha256="dummy-overlap-v1", max_length=max_length)

    def tokenize(self, pairs: list[tuple[str, str]]) -> Encoded:
        rows: list[list[int]] = []
        types: list[list[int]] = []
        for q, p in pairs:
            q_ids = [_hash(t) for t in terms(q)][: self.info.max_length // 2]
            p_ids = [_hash(t) for t in terms(p)][: self.info.max_length - len(q_ids) - 1]
            rows.append(q_ids + [_SEP] + p_ids)
            types.append([0] * (len(q_ids) + 1) + [1] * len(p_ids))
        ids, mask = _pad(rows)
        type_ids, _ = _pad(types)
        return Encoded(input_ids=ids, attention_mask=mask, token_type_ids=type_ids)

    def infer(self, encoded: Encoded) -> FloatArray:
        assert encoded.token_type_ids is not None
        out = np.empty(encoded.batch_size, dtype=np.float32)
        for i in range(encoded.batch_size):
            live = (encoded.attention_mask[i] == 1) & (encoded.input_ids[i] != _SEP)
            ids, types = encoded.input_ids[i][live], encoded.token_type_ids[i][live]
            query, passage = set(ids[types == 0].tolist()), set(ids[types == 1].tolist())
            share = len(query & passage) / len(query) if query else 0.0
            out[i] = 10.0 * share - 5.0
        return out
