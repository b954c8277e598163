"""Cached passage states for the split reranker (README "Cached passage states").

The split cross-encoder's lower layers see the passage alone, so their output for a chunk
(its *passage states*: one vector per token at the split point) can be computed once at
ingest, stored with the chunk, and reused by every rerank: a query then pays only its own
lower layers and the joint layers.

Stored form (``encode_states``): per-token symmetric int8, one fp16 scale per token, behind
a 5-byte header (format byte, token count, width). A state blob is only ever read back by
the model it was written for: the engines store it with a ``states_key`` (the reranker's
id, the hash of its lower graph and this format) and a rerank asks for exactly that key,
so a model change makes every stored blob stale and the reranker computes states instead.
"""

from __future__ import annotations

import struct

import numpy as np
import numpy.typing as npt

# 1: per-token absmax int8 + fp16 scale, every token of the passage (padding dropped).
STATES_FORMAT = 1
_HEADER = struct.Struct("<BHH")  # format, tokens, width


def rerank_passage_text(title: str, text: str) -> str:
    """The passage the reranker judges for a chunk: what ingest computes states for must be
    exactly what a rerank would otherwise tokenize."""
    return f"{title}\n{text}"


def encode_states(states: npt.NDArray[np.float32]) -> bytes:
    """[tokens, width] float states -> compact bytes (see module doc)."""
    x = np.asarray(states, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"passage states must be [tokens, width], got shape {x.shape}")
    tokens, width = x.shape
    scale = np.abs(x).max(axis=1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float16)
    q = np.clip(np.rint(x / scale.astype(np.float32)[:, None]), -127, 127).astype(np.int8)
    return _HEADER.pack(STATES_FORMAT, tokens, width) + scale.astype("<f2").tobytes() + q.tobytes()


def decode_states(blob: bytes) -> npt.NDArray[np.float32]:
    """Bytes written by ``encode_states`` -> [tokens, width] float32; ValueError when the
    blob is not one (wrong format byte or length)."""
    if len(blob) < _HEADER.size:
        raise ValueError("passage states blob shorter than its header")
    fmt, tokens, width = _HEADER.unpack_from(blob)
    if fmt != STATES_FORMAT:
        raise ValueError(f"passage states format {fmt}, this build reads {STATES_FORMAT}")
    expected = _HEADER.size + tokens * 2 + tokens * width
    if len(blob) != expected:
        raise ValueError(f"passage states blob is {len(blob)} bytes, its header says {expected}")
    offset = _HEADER.size
    scale = np.frombuffer(blob, dtype="<f2", count=tokens, offset=offset).astype(np.float32)
    q = np.frombuffer(blob, dtype=np.int8, count=tokens * width, offset=offset + tokens * 2)
    return q.reshape(tokens, width).astype(np.float32) * scale[:, None]
