"""Exact nearest-neighbour search over unit vectors, scored like OpenSearch's lucene engine
with ``space_type: l2``: rank by squared L2 distance, score = 1 / (1 + l2^2) in float32.

Exact search is affordable at this corpus size (one matrix-vector product per query) and
makes results deterministic, which the shared test suite relies on.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from service.engines.embedded.bm25 import BoolArray, top_k

# Candidates kept from the fast dot-product pass before distances are recomputed exactly.
_SHORTLIST_SLACK = 32


class VectorIndex:
    """Row ``slot`` of a growable float32 matrix holds that slot's vector."""

    def __init__(self) -> None:
        self.dimension: int | None = None
        self._matrix = np.zeros((0, 0), dtype=np.float32)
        self._sq_norms = np.zeros(0, dtype=np.float32)
        self._present = np.zeros(0, dtype=np.bool_)  # live slot with a vector
        self._size = 0

    def _reserve(self, n: int) -> None:
        if n <= len(self._present):
            return
        assert self.dimension is not None
        cap = max(n, 2 * len(self._present), 1024)
        matrix = np.zeros((cap, self.dimension), dtype=np.float32)
        if len(self._matrix):
            matrix[: len(self._matrix)] = self._matrix
        self._matrix = matrix
        for name in ("_sq_norms", "_present"):
            old = getattr(self, name)
            grown = np.zeros(cap, dtype=old.dtype)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def check(self, vector: npt.NDArray[np.float32]) -> str | None:
        """Why ``vector`` cannot be stored, or None when it can."""
        if vector.ndim != 1 or vector.shape[0] == 0:
            return f"vector must be one-dimensional and non-empty, got shape {vector.shape}"
        if self.dimension is not None and vector.shape[0] != self.dimension:
            return f"vector dimension {vector.shape[0]} != index dimension {self.dimension}"
        if not np.all(np.isfinite(vector)):
            return "vector has non-finite values"
        return None

    def add(self, slot: int, vector: npt.NDArray[np.float32]) -> None:
        if self.dimension is None:
            self.dimension = int(vector.shape[0])
        self._reserve(slot + 1)
        self._size = max(self._size, slot + 1)
        row = np.asarray(vector, dtype=np.float32)
        self._matrix[slot] = row
        self._sq_norms[slot] = np.dot(row, row)
        self._present[slot] = True

    def get(self, slot: int) -> npt.NDArray[np.float32] | None:
        if slot >= self._size or not self._present[slot]:
            return None
        row: npt.NDArray[np.float32] = self._matrix[slot].copy()
        return row

    def get_present(self, slot: int) -> bool:
        """Whether ``slot`` has a vector (without copying it)."""
        return slot < self._size and bool(self._present[slot])

    def delete(self, slot: int) -> None:
        if slot < self._size:
            self._present[slot] = False

    def search(
        self, query: npt.NDArray[np.float32], k: int, allowed: BoolArray | None = None
    ) -> list[tuple[int, float]]:
        """Top ``k`` ``(slot, squared L2 distance)``, nearest first, ties by lower slot."""
        if k <= 0 or self.dimension is None or self._size == 0:
            return []
        q = np.asarray(query, dtype=np.float32)
        mask = self._present[: self._size]
        if allowed is not None:
            mask = mask & allowed[: self._size]
        cand = np.flatnonzero(mask)
        if len(cand) == 0:
            return []
        matrix = self._matrix[: self._size]
        # |x - q|^2 = |x|^2 + |q|^2 - 2 x.q: one BLAS pass over every row, then the shortlist
        # is re-measured exactly so distances match an elementwise float32 computation.
        approx = self._sq_norms[: self._size] - 2 * (matrix @ q)
        shortlist = top_k(cand, approx[cand], k + _SHORTLIST_SLACK, descending=False)
        rows = np.array([slot for slot, _ in shortlist], dtype=np.int64)
        diff = matrix[rows] - q
        exact = np.einsum("ij,ij->i", diff, diff).astype(np.float32)
        return top_k(rows, exact, k, descending=False)

    def compact(self, remap: npt.NDArray[np.int64], new_size: int) -> None:
        """Renumber slots as ``Bm25Index.compact`` does."""
        if self.dimension is None:  # nothing stored (no chunk had this vector): nothing to renumber
            return
        remap = remap[: self._size]
        kept = remap >= 0
        targets = remap[kept]
        cap = max(new_size, 1024)
        matrix = np.zeros((cap, self.dimension), dtype=np.float32)
        matrix[targets] = self._matrix[: self._size][kept]
        sq_norms = np.zeros(cap, dtype=np.float32)
        sq_norms[targets] = self._sq_norms[: self._size][kept]
        present = np.zeros(cap, dtype=np.bool_)
        present[targets] = self._present[: self._size][kept]
        self._matrix, self._sq_norms, self._present = matrix, sq_norms, present
        self._size = new_size


def similarity(squared_distance: float) -> float:
    """OpenSearch lucene-engine l2 score: 1 / (1 + l2^2), in float32 like Lucene."""
    return float(np.float32(1) / (np.float32(1) + np.float32(squared_distance)))
