"""An LRU cache of query embeddings, keyed by the model's ONNX hash and the normalised query.

Agents repeat themselves (retries, the same gap asked again, query variants shared across
plans), and a query embedding is the one model call on the hybrid path. The key must map
texts to one entry only when the model would give them the same token ids, so the
normalisation is exactly what e5's tokenizer does to whitespace anyway: runs of blanks
collapse to one space and leading blanks vanish after the ``query: `` prefix; trailing
blanks are kept (they become a token). ``tests/unit/models/test_query_cache.py`` checks
that with the real tokenizer. Case, width and punctuation are never folded.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np

from service.models.base import FloatArray

_BLANKS = re.compile(r"[ \t\n\r\f]+")


def normalise_query(text: str) -> str:
    return _BLANKS.sub(" ", text).lstrip(" ")


class QueryEmbeddingCache:
    """Bounded LRU; ``size`` 0 disables it. Used only on the event loop (no lock)."""

    def __init__(self, size: int, model_sha256: str) -> None:
        self.size = size
        self.model = model_sha256
        self._entries: OrderedDict[tuple[str, str], FloatArray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> FloatArray | None:
        if not self.size:
            return None
        key = (self.model, normalise_query(text))
        vector = self._entries.get(key)
        if vector is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return vector

    def put(self, text: str, vector: FloatArray) -> None:
        if not self.size:
            return
        frozen = np.array(vector, dtype=np.float32)
        frozen.setflags(write=False)  # shared by every caller that hits it
        self._entries[(self.model, normalise_query(text))] = frozen
        self._entries.move_to_end((self.model, normalise_query(text)))
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
