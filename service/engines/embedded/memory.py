"""The embedded engine's in-memory state: every live chunk in a numbered slot, with BM25
postings, vectors and filter postings keyed by slot.

Slots grow in insertion order, which is also the tie-break order (Lucene ranks the lower doc id
first). Deleted slots are only flagged; once they outnumber the live ones, ``compact``
renumbers everything in one pass. Not thread-safe: the engine serialises access.
"""

from __future__ import annotations

import dataclasses
import heapq
from array import array
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from service.engines.base import ChunkRecord, SearchFilter, VectorField
from service.engines.embedded.bm25 import Bm25Index, BoolArray
from service.engines.embedded.knn import VectorIndex

_COMPACT_MIN_DEAD = 1024

DocKey = tuple[str, str]  # (source_id, version)


class MemoryIndex:
    def __init__(self) -> None:
        self.bm25 = Bm25Index()
        self.vectors = VectorIndex()
        self.latin_vectors = VectorIndex()  # only slots whose chunk has a latin_vector
        self._records: list[ChunkRecord | None] = []  # by slot; without the vectors and states
        self._slot_of: dict[str, int] = {}  # chunk_id -> slot
        self._doc_slots: dict[DocKey, list[int]] = {}
        self.doc_hashes: dict[DocKey, str] = {}
        # "field\0value" -> slots having it; fields: collection, source, acl, meta:<key>
        self._postings: dict[str, array[int]] = {}
        self._public: array[int] = array("i")  # slots whose acl is empty
        self._dead = 0

    def vector_index(self, field: VectorField) -> VectorIndex:
        return self.latin_vectors if field is VectorField.LATIN else self.vectors

    @property
    def chunk_count(self) -> int:
        return len(self._slot_of)

    def owner_of(self, chunk_id: str) -> DocKey | None:
        slot = self._slot_of.get(chunk_id)
        if slot is None:
            return None
        record = self._records[slot]
        assert record is not None
        return (record.source_id, record.version)

    def _post(self, key: str, slot: int) -> None:
        self._postings.setdefault(key, array("i")).append(slot)

    def add_document(
        self, key: DocKey, content_hash: str, chunks: Iterable[tuple[ChunkRecord, list[str]]]
    ) -> None:
        """Add one source version's chunks with their analysed ``search_text`` terms."""
        slots = self._doc_slots.setdefault(key, [])
        for record, terms in chunks:
            slot = len(self._records)
            if record.vector is not None:
                self.vectors.add(slot, record.vector)
            if record.latin_vector is not None:
                self.latin_vectors.add(slot, record.latin_vector)
            self._records.append(dataclasses.replace(record, vector=None, latin_vector=None, rerank_states=None,
                                                     rerank_states_key=""))
            self._slot_of[record.chunk_id] = slot
            slots.append(slot)
            self.bm25.add(slot, terms)
            self._post(f"collection\0{record.collection}", slot)
            self._post(f"source\0{record.source_id}", slot)
            for group in record.acl:
                self._post(f"acl\0{group}", slot)
            if not record.acl:
                self._public.append(slot)
            for meta_key, value in record.metadata.items():
                self._post(f"meta:{meta_key}\0{value}", slot)
        if slots:
            self.doc_hashes[key] = content_hash
        else:
            del self._doc_slots[key]

    def delete_document(self, key: DocKey) -> int:
        slots = self._doc_slots.pop(key, [])
        self.doc_hashes.pop(key, None)
        for slot in slots:
            record = self._records[slot]
            assert record is not None
            del self._slot_of[record.chunk_id]
            self._records[slot] = None
            self.bm25.delete(slot)
            self.vectors.delete(slot)
            self.latin_vectors.delete(slot)
        self._dead += len(slots)
        if self._dead >= max(_COMPACT_MIN_DEAD, self.chunk_count):
            self.compact()
        return len(slots)

    def documents(self, source_id: str) -> list[DocKey]:
        return [key for key in self._doc_slots if key[0] == source_id]

    def record(self, chunk_id: str) -> ChunkRecord | None:
        """The stored chunk with its vectors restored."""
        slot = self._slot_of.get(chunk_id)
        if slot is None:
            return None
        record = self._records[slot]
        assert record is not None
        return dataclasses.replace(record, vector=self.vectors.get(slot), latin_vector=self.latin_vectors.get(slot))

    def chunks_without(self, field: VectorField, after: str, limit: int) -> list[ChunkRecord]:
        """Live chunks without a ``field`` vector, by chunk id after ``after``, at most ``limit``."""
        index = self.vector_index(field)
        return self.chunks_after(after, limit, lambda slot: not index.get_present(slot))

    def chunks_after(self, after: str, limit: int, keep: Callable[[int], bool] = lambda _: True) -> list[ChunkRecord]:
        """Up to ``limit`` live chunks by chunk id after ``after`` (those whose slot ``keep`` takes)."""
        ids = heapq.nsmallest(limit, (cid for cid, slot in self._slot_of.items() if cid > after and keep(slot)))
        return [self.hit_record(self._slot_of[cid]) for cid in ids]

    def set_vector(self, field: VectorField, chunk_id: str, vector: npt.NDArray[np.float32]) -> None:
        slot = self._slot_of.get(chunk_id)
        if slot is not None:
            self.vector_index(field).add(slot, vector)

    def hit_record(self, slot: int) -> ChunkRecord:
        record = self._records[slot]
        assert record is not None
        return record

    def _any_of(self, field: str, values: Sequence[str]) -> BoolArray:
        mask = np.zeros(len(self._records), dtype=np.bool_)
        for value in values:
            slots = self._postings.get(f"{field}\0{value}")
            if slots:
                mask[np.array(slots, dtype=np.int64)] = True
        return mask

    def allowed(self, flt: SearchFilter) -> BoolArray | None:
        """Slots passing ``flt`` (None = no restriction); dead slots are masked elsewhere."""
        masks: list[BoolArray] = []
        if flt.collections:
            masks.append(self._any_of("collection", flt.collections))
        if flt.source_ids:
            masks.append(self._any_of("source", flt.source_ids))
        for meta_key, value in flt.metadata.items():
            masks.append(self._any_of(f"meta:{meta_key}", [value]))
        if flt.acl_groups is not None:
            acl = self._any_of("acl", flt.acl_groups)
            acl[np.array(self._public, dtype=np.int64)] = True
            masks.append(acl)
        if not masks:
            return None
        combined = masks[0]
        for mask in masks[1:]:
            combined &= mask
        return combined

    def compact(self) -> None:
        """Drop dead slots, renumbering the live ones in their original order."""
        live = np.array([r is not None for r in self._records], dtype=np.bool_)
        remap: npt.NDArray[np.int64] = np.full(len(self._records), -1, dtype=np.int64)
        remap[live] = np.arange(int(live.sum()), dtype=np.int64)
        new_size = int(live.sum())
        self.bm25.compact(remap, new_size)
        self.vectors.compact(remap, new_size)
        self.latin_vectors.compact(remap, new_size)
        self._records = [r for r in self._records if r is not None]
        self._slot_of = {r.chunk_id: i for i, r in enumerate(self._records) if r is not None}
        self._doc_slots = {
            key: [int(remap[s]) for s in slots] for key, slots in self._doc_slots.items()
        }

        def renumber(slots: array[int]) -> array[int]:
            new = remap[np.array(slots, dtype=np.int64)]
            return array("i", new[new >= 0].astype(np.int32).tobytes())

        self._postings = {k: s for k, v in self._postings.items() if len(s := renumber(v))}
        self._public = renumber(self._public)
        self._dead = 0
