"""Cached passage states for the split reranker (README "Cached passage states").

The split cross-encoder's lower layers see the passage alone, so their output for a chunk
(its *passage states*: one vector per token at the split point) can be computed once at
ingest, stored with the chunk, and reused by every rerank: a query then pays only its own
lower layers and the joint layers.

Stored form (``StatesCodec``): per-token symmetric int8, one fp16 scale per token, behind a
5-byte header (format byte, token count, width). Format 1 keeps all ``hidden`` dims (~31 KB
for an 80-token chunk); format 2 first projects each token onto the model's fitted principal
components (``states_projection.npz``, offline/training/states_projection.py) and expands
it back before the joint layers, ``dims`` + 2 bytes a token. A blob is only ever read back
by the model it was written for: the engines store it with a ``states_key`` (the reranker's
id, the hashes of its lower graph and projection, the format) and a rerank asks for exactly
that key, so a model change makes every stored blob stale and the reranker computes states.
A reranker served as two towers (``towers.py``) stores each passage's tower vector instead,
format 3: one row of ``hidden`` int8 (~0.4 KB).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
# 1: per-token absmax int8 + fp16 scale, every token of the passage (padding dropped).
STATES_FORMAT = 1
# 2: the same after projecting each token onto the fitted components.
PROJECTED_FORMAT = 2
# 3: the reranker's passage tower vector (models/towers.py): one row, int8 like format 1.
VECTOR_FORMAT = 3
# The passage layout the stored states encode (``rerank_passage_text``), in the states key:
# "t2" added the breadcrumb (states written for the "title\ntext" layout are not read).
STATES_TEXT = "t2"
PROJECTION_FILE = "states_projection.npz"
_HEADER = struct.Struct("<BHH")  # format, tokens, width


def rerank_passage_text(title: str, breadcrumb: str, text: str) -> str:
    """The passage the reranker judges for a chunk, and what ingest embeds and searches it as
    (``chunking.embedded_text``): the document title, the chunk's breadcrumb and its text.
    One layout for both, so the reranker reads the section a chunk sits in as the first stage
    does, and the embedding pass's hidden states are the passage states wherever the passage
    fits the reranker's cap (``one_pass``). States stored for a chunk must be for exactly the
    text a rerank would otherwise tokenize: ``STATES_TEXT`` in the states key names this layout."""
    return f"{title}\n{breadcrumb}\n{text}".strip()


def encode_states(states: npt.NDArray[np.float32], fmt: int = STATES_FORMAT) -> bytes:
    """[tokens, width] float states -> compact bytes (see module doc)."""
    x = np.asarray(states, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"passage states must be [tokens, width], got shape {x.shape}")
    tokens, width = x.shape
    scale = np.abs(x).max(axis=1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float16)
    q = np.clip(np.rint(x / scale.astype(np.float32)[:, None]), -127, 127).astype(np.int8)
    header: bytes = _HEADER.pack(fmt, tokens, width)
    return header + bytes(scale.astype("<f2").tobytes()) + bytes(q.tobytes())


def decode_states(blob: bytes, fmt: int = STATES_FORMAT) -> npt.NDArray[np.float32]:
    """Bytes written by ``encode_states`` -> [tokens, width] float32; ValueError when the
    blob is not one (wrong format byte or length)."""
    if len(blob) < _HEADER.size:
        raise ValueError("passage states blob shorter than its header")
    found, tokens, width = _HEADER.unpack_from(blob)
    if found != fmt:
        raise ValueError(f"passage states format {found}, this model reads {fmt}")
    expected = _HEADER.size + tokens * 2 + tokens * width
    if len(blob) != expected:
        raise ValueError(f"passage states blob is {len(blob)} bytes, its header says {expected}")
    offset = _HEADER.size
    scale = np.frombuffer(blob, dtype="<f2", count=tokens, offset=offset).astype(np.float32)
    q = np.frombuffer(blob, dtype=np.int8, count=tokens * width, offset=offset + tokens * 2)
    return q.reshape(tokens, width).astype(np.float32) * scale[:, None]


def save_projection(path: Path, mean: F32, components: F32) -> None:
    """``mean`` [hidden] and orthonormal ``components`` [dims, hidden], fp32."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez(f, mean=np.asarray(mean, np.float32), components=np.asarray(components, np.float32))


@dataclass(frozen=True)
class StatesCodec:
    """What a model stores for a passage and how it gets the states back (module doc)."""

    mean: F32 | None = None  # [hidden]; None: no projection (format 1)
    components: F32 | None = None  # [dims, hidden]
    vectors: bool = False  # one pooled vector per passage (format 3), never projected

    @classmethod
    def load(cls, projection: Path | None) -> StatesCodec:
        if projection is None:
            return cls()
        with np.load(projection) as z:
            mean, components = np.asarray(z["mean"], np.float32), np.asarray(z["components"], np.float32)
        if mean.ndim != 1 or components.ndim != 2 or components.shape[1] != mean.shape[0]:
            raise ValueError(f"{projection}: mean {mean.shape} and components {components.shape} do not fit")
        return cls(mean, components)

    @property
    def fmt(self) -> int:
        if self.vectors:
            return VECTOR_FORMAT
        return STATES_FORMAT if self.components is None else PROJECTED_FORMAT

    def encode(self, states: F32) -> bytes:
        if self.vectors:
            return encode_states(states, VECTOR_FORMAT)
        if self.components is None or self.mean is None:
            return encode_states(states)
        projected: F32 = ((np.asarray(states, np.float32) - self.mean) @ self.components.T).astype(np.float32)
        return encode_states(projected, PROJECTED_FORMAT)

    def decode(self, blob: bytes) -> F32:
        return self.decode_many([blob])[0]

    def decode_many(self, blobs: list[bytes]) -> list[F32]:
        """Several blobs, expanded with one matrix product (a rerank's 20 at once)."""
        ys = [decode_states(b, self.fmt) for b in blobs]
        if self.vectors and any(len(y) != 1 for y in ys):
            raise ValueError("a passage vector blob holds one row")
        if self.components is None or self.mean is None or not ys:
            return ys
        dims = self.components.shape[0]
        for y in ys:
            if y.shape[1] != dims:
                raise ValueError(f"passage states have {y.shape[1]} dims, the projection {dims}")
        full: F32 = np.concatenate(ys) @ self.components + self.mean
        return np.split(full, np.cumsum([len(y) for y in ys])[:-1])
