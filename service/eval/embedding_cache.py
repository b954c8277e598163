"""An on-disk cache of passage embeddings, as an ``EmbeddingBackend`` wrapper.

Embedding a 27k-answer corpus takes minutes per model on a small CPU; an evaluation re-ingests
it for every engine, mode set and run. ``CachedEmbedder`` wraps the real backend and is passed
as ``embedder=`` to ``App.build``, so ingest still goes through the service's model runtime
and engine: only passage vectors the same model (ONNX sha256, max length) already produced
for the same text are read back instead of recomputed. Query embeddings are never cached, so
query latency stays real.

Layout: ``<root>/<model-sha256[:16]>-L<max_length>/shard-*.npz``, each shard holding
``keys`` (sha256 of kind + text: [n, 32] uint8) and ``vectors`` ([n, dim] float32).
Shards are append-only (new vectors are flushed every ``flush_every`` and on ``flush()``),
so concurrent writers never corrupt each other. ``root`` defaults to
``~/.cache/retrieval-service/embeddings`` (``RETRIEVAL_EMBEDDINGS_CACHE``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.models.base import EmbeddingBackend, Encoded, FloatArray, TextKind

log = logging.getLogger(__name__)


def default_cache_root() -> Path:
    env = os.environ.get("RETRIEVAL_EMBEDDINGS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "retrieval-service" / "embeddings"


def text_key(text: str, kind: TextKind = "passage") -> bytes:
    return hashlib.sha256(f"{kind}\0{text}".encode()).digest()


def _key_array(keys: list[bytes]) -> npt.NDArray[np.uint8]:
    """[n, 32] uint8 (a fixed-width bytes dtype would silently drop trailing NUL bytes)."""
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)


class CachedEmbedder(EmbeddingBackend):
    """Looks passages up in the cache before calling ``inner``; stores what it computes."""

    def __init__(self, inner: EmbeddingBackend, root: Path | None = None, *, flush_every: int = 1024) -> None:
        self.inner = inner
        self.info = inner.info
        # Served alone or not, a query's vector must be what the wrapped model gives it: the
        # runtime isolates requests exactly when the wrapped model needs it.
        self.batch_invariant = inner.batch_invariant
        self.dir = (root or default_cache_root()) / f"{inner.info.sha256[:16]}-L{inner.info.max_length}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._vectors: dict[bytes, FloatArray] = {}
        self._pending: dict[bytes, FloatArray] = {}
        self._own_shards: set[str] = set()  # loaded or written by this instance
        self._load()

    def _load(self) -> None:
        for shard in sorted(self.dir.glob("shard-*.npz")):
            try:
                with np.load(shard) as data:
                    keys, vectors = data["keys"], data["vectors"]
            except (OSError, ValueError, KeyError) as exc:  # a torn write from a killed run
                log.warning("ignoring unreadable embedding cache shard %s: %s", shard, exc)
                continue
            if vectors.ndim != 2 or vectors.shape[1] != self.dimension:
                continue
            if keys.dtype.kind == "S":  # early shards: fixed-width bytes drop trailing NULs
                raw = [bytes(k).ljust(32, b"\0") for k in keys]
            else:
                raw = [row.tobytes() for row in keys.reshape(-1, 32)]
            for k, v in zip(raw, vectors):
                self._vectors[k] = v
            self._own_shards.add(shard.name)

    def __len__(self) -> int:
        return len(self._vectors)

    def contains(self, text: str) -> bool:
        return text_key(text) in self._vectors

    def flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            keys = _key_array(list(self._pending))
            vectors = np.stack(list(self._pending.values())).astype(np.float32)
            self._pending = {}
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}.npz"
        np.savez(tmp, keys=keys, vectors=vectors)
        final = self.dir / f"shard-{int(time.time())}-{uuid.uuid4().hex[:8]}.npz"
        tmp.rename(final)
        self._own_shards.add(final.name)

    def _store(self, keys: Sequence[bytes], vectors: FloatArray) -> None:
        with self._lock:
            for k, v in zip(keys, vectors):
                self._vectors[k] = v
                self._pending[k] = v
            full = len(self._pending) >= self.flush_every
        if full:
            self.flush()

    # -- EmbeddingBackend ---------------------------------------------------------------

    def tokenize(self, texts: list[str], kind: TextKind) -> Encoded:
        if kind != "passage":
            return self.inner.tokenize(texts, kind)
        keys = [text_key(t) for t in texts]
        misses = [i for i, k in enumerate(keys) if k not in self._vectors]
        inner = self.inner.tokenize([texts[i] for i in misses], kind) if misses else None
        empty = np.zeros((len(texts), 1), dtype=np.int64)
        base = inner if inner is not None else Encoded(empty, empty)
        return Encoded(base.input_ids, base.attention_mask, base.token_type_ids,
                       extra={"cache": (keys, misses, inner, len(texts))})

    def infer(self, encoded: Encoded) -> FloatArray:
        cached = encoded.extra.get("cache")
        if cached is None:
            return self.inner.infer(encoded)
        keys, misses, inner, n = cached
        out = np.zeros((n, self.dimension), dtype=np.float32)
        miss_set = set(misses)
        for i, k in enumerate(keys):
            if i not in miss_set:
                out[i] = self._vectors[k]
        if inner is not None:
            computed = self.inner.infer(inner)
            out[misses] = computed
            self._store([keys[i] for i in misses], computed)
        self.hits += n - len(misses)
        self.misses += len(misses)
        return out

    # -- bulk pre-computation -------------------------------------------------------------

    def warm(self, texts: Sequence[str], *, batch: int = 16, workers: int = 2,
             progress: Callable[[int, int], None] | None = None) -> int:
        """Embed every uncached passage in ``texts``, length-sorted batches on ``workers``
        threads (padding waste is what makes random batches slow). Returns how many were
        computed. The service later ingests the same texts and finds them here."""
        todo = sorted({t for t in texts if text_key(t) not in self._vectors}, key=len)
        batches = [todo[i : i + batch] for i in range(0, len(todo), batch)]
        done = 0

        def run(chunk: list[str]) -> int:
            enc = self.inner.tokenize(chunk, "passage")
            self._store([text_key(t) for t in chunk], self.inner.infer(enc))
            return len(chunk)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            for n in pool.map(run, batches):
                done += n
                if progress is not None:
                    progress(done, len(todo))
        self.flush()
        return len(todo)

    def compact(self) -> None:
        """Merge the shards this instance loaded or wrote into one (after a large warm-up);
        shards other processes wrote meanwhile are left alone."""
        self.flush()
        shards = sorted(s for s in self.dir.glob("shard-*.npz") if s.name in self._own_shards)
        if len(shards) <= 1:
            return
        with self._lock:
            keys = _key_array(list(self._vectors))
            vectors = np.stack(list(self._vectors.values())).astype(np.float32)
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}.npz"
        np.savez(tmp, keys=keys, vectors=vectors)
        final = self.dir / f"shard-{int(time.time())}-all-{uuid.uuid4().hex[:8]}.npz"
        tmp.rename(final)
        for s in shards:
            s.unlink(missing_ok=True)
        self._own_shards = {final.name}
