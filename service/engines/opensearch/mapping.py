"""What the OpenSearch engine sends: the index template, the documents and the query bodies.

Pure functions (no I/O) so the shapes are unit-tested without a server.

Index design (one index for every collection, behind an alias):
- ``{prefix}-chunks`` is an alias; the concrete index is ``{prefix}-chunks-v{N}``. A reindex
  (new mapping, new model) fills ``-v{N+1}`` and swaps the alias in one ``_aliases`` call, so
  readers never see a half-built index. The composable template ``{prefix}-chunks`` matches
  ``{prefix}-chunks-v*``, so every generation gets the same settings and mapping.
- FAQ and document chunks share the index and are told apart by the ``collection`` keyword,
  filtered inside the query. One index (one shard by default) keeps BM25 statistics over the
  whole corpus, which is what the embedded engine computes, so both engines score alike.
- ``search_text`` is the single BM25 field, built-in ``cjk`` analyzer, BM25 k1=1.2 b=0.75
  (OpenSearch's default similarity). ``vector`` is a lucene HNSW ``knn_vector`` with
  ``space_type: l2`` (the Maven k-NN zip has no native engines), so the kNN score is
  ``1 / (1 + d^2)``.
- ACL: ``acl`` holds the chunk's groups; an empty list leaves the field absent, and the ACL
  filter is "no ``acl`` field OR one of the caller's groups". No sentinel group is needed,
  so no real group name can collide with one.
- ``metadata`` is an object whose leaves are mapped as ``keyword`` by a dynamic template, so
  ``metadata.<key>`` is an exact term filter. Everything else is ``dynamic: strict``.
- ``rerank_states`` (``binary``: base64 in ``_source``, neither indexed nor in doc values) and
  ``rerank_states_key`` (keyword, not indexed) hold the reranker's passage states in the
  chunk's own document: a re-ingest's index operation replaces them with the chunk, a delete
  takes them along, and no second index has to be kept in step. Hits leave them out; a
  rerank reads them by id (realtime ``mget``). Older indices get the two fields added in
  place (``STATES_PROPERTIES``, an additive mapping update).
- ``latin_vector``: a second lucene HNSW ``knn_vector``, the Latin-script embedder's, which
  only chunks without Han characters carry (README "The Latin-script dense leg"); its kNN
  searches it alone. Added in place to older indices like the states fields.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.engines.base import ChunkRecord, SearchFilter, Vector, VectorField

JSON = dict[str, Any]

# Bump when the mapping changes incompatibly: new indices get the new number, and a reindex
# moves the alias to them.
MAPPING_VERSION = 1

# BM25 parameters, spelled out so the mapping states them (they are OpenSearch's defaults).
BM25_K1 = 1.2
BM25_B = 0.75

# HNSW build parameters for the lucene engine (OpenSearch defaults: m=16, ef_construction=100).
HNSW_M = 16
HNSW_EF_CONSTRUCTION = 128

# Fields returned with hits: everything but the vectors and the passage states.
HIT_SOURCE_EXCLUDES = ["vector", "latin_vector", "rerank_states", "rerank_states_key"]
# The cached reranker passage states (README "Cached passage states"): stored, never searched.
STATES_PROPERTIES: JSON = {
    "rerank_states": {"type": "binary"},
    "rerank_states_key": {"type": "keyword", "index": False, "doc_values": False},
}
STATES_SOURCE_INCLUDES = "content_hash,rerank_states,rerank_states_key"
# Write-back of rerank-computed states (``put_passage_states``): only onto the chunk version
# they were computed for; anything else is left untouched (``noop``).
PUT_STATES_SCRIPT = (
    "if (ctx._source.content_hash == params.content_hash) {"
    " ctx._source.rerank_states = params.states; ctx._source.rerank_states_key = params.key;"
    " } else { ctx.op = 'noop'; }"
)

# Backfill of a vector field (``put_vectors``): only onto the chunk version it was computed
# for, and only where that chunk has none; anything else is left untouched (``noop``).
PUT_VECTOR_SCRIPT = (
    "if (ctx._source.content_hash == params.content_hash && ctx._source[params.field] == null) {"
    " ctx._source[params.field] = params.vector;"
    " } else { ctx.op = 'noop'; }"
)

def alias_name(prefix: str) -> str:
    return f"{prefix}-chunks"


def index_name(prefix: str, generation: int) -> str:
    return f"{prefix}-chunks-v{generation}"


def index_generation(prefix: str, concrete: str) -> int | None:
    """``retrieval-chunks-v3`` -> 3; None for a name this engine did not create."""
    head = f"{prefix}-chunks-v"
    if not concrete.startswith(head) or not concrete[len(head) :].isdigit():
        return None
    return int(concrete[len(head) :])


def template_name(prefix: str) -> str:
    return f"{prefix}-chunks"


def knn_vector(dimension: int) -> JSON:
    return {
        "type": "knn_vector",
        "dimension": dimension,
        "method": {
            "name": "hnsw",
            "engine": "lucene",
            "space_type": "l2",
            "parameters": {"m": HNSW_M, "ef_construction": HNSW_EF_CONSTRUCTION},
        },
    }


def latin_vector_properties(dimension: int) -> JSON:
    """The Latin-script embedder's vector (``VectorField.LATIN``): only chunks without Han
    characters have one; an index made before it gets it added in place at start."""
    return {VectorField.LATIN.value: knn_vector(dimension)}


def chunk_mapping(dimension: int, latin_dimension: int | None = None) -> JSON:
    keyword = {"type": "keyword"}
    stored_text = {"type": "text", "index": False}
    return {
        "dynamic": "strict",
        "_meta": {"mapping_version": MAPPING_VERSION, "dimension": dimension},
        "dynamic_templates": [
            {
                "metadata_keywords": {
                    "path_match": "metadata.*",
                    "match_mapping_type": "*",
                    "mapping": {"type": "keyword"},
                }
            }
        ],
        "properties": {
            "chunk_id": keyword,
            "source_id": keyword,
            "version": keyword,
            # "source@version": one value per document, for exact document counts.
            "doc_key": keyword,
            "chunk_index": {"type": "integer"},
            "collection": keyword,
            "status": keyword,
            "acl": keyword,
            "content_hash": keyword,
            "metadata": {"type": "object", "dynamic": True},
            "title": stored_text,
            "breadcrumb": stored_text,
            "text": stored_text,
            "parent_text": stored_text,
            "search_text": {"type": "text", "analyzer": "cjk", "similarity": "bm25_default"},
            **STATES_PROPERTIES,
            VectorField.PRIMARY.value: knn_vector(dimension),
            **latin_vector_properties(latin_dimension or dimension),
        },
    }


def index_settings(shards: int, replicas: int) -> JSON:
    return {
        "index": {
            "number_of_shards": shards,
            "number_of_replicas": replicas,
            "knn": True,
            "similarity": {"bm25_default": {"type": "BM25", "k1": BM25_K1, "b": BM25_B}},
        }
    }


def index_template(prefix: str, dimension: int, shards: int, replicas: int, latin_dimension: int | None = None) -> JSON:
    """Composable template applied to every generation of the chunk index."""
    return {
        "index_patterns": [f"{prefix}-chunks-v*"],
        "priority": 200,
        "_meta": {"owner": "retrieval-service", "mapping_version": MAPPING_VERSION},
        "template": {
            "settings": index_settings(shards, replicas),
            "mappings": chunk_mapping(dimension, latin_dimension),
        },
    }


def create_index_body(prefix: str) -> JSON:
    """Body for creating a generation: settings come from the template; the alias is
    attached in the same request, so the alias never points at nothing."""
    return {"aliases": {alias_name(prefix): {"is_write_index": True}}}


def mapped_dimension(mapping_response: Mapping[str, Any], field: VectorField = VectorField.PRIMARY) -> int | None:
    """Dimension of ``field`` in a ``GET <index>/_mapping`` response (first index)."""
    for body in mapping_response.values():
        props = body.get("mappings", {}).get("properties", {})
        dim = props.get(field.value, {}).get("dimension")
        return int(dim) if dim is not None else None
    return None


# -- documents -------------------------------------------------------------------------------


def vector_problem(vector: Vector | None, dimension: int) -> str | None:
    """Why a vector cannot be indexed (or queried) with this mapping, or None."""
    if vector is None:
        return None
    arr = np.asarray(vector, dtype=np.float32)
    if arr.ndim != 1 or arr.shape[0] != dimension:
        return f"vector shape {arr.shape} != ({dimension},)"
    if not np.all(np.isfinite(arr)):
        return "vector has non-finite values"
    return None


def vector_json(vector: Vector) -> list[float]:
    # float32 -> Python float is exact, and OpenSearch stores float32: round trip is lossless.
    return [float(x) for x in np.asarray(vector, dtype=np.float32)]


def chunk_to_doc(chunk: ChunkRecord) -> JSON:
    doc: JSON = {
        "chunk_id": chunk.chunk_id,
        "source_id": chunk.source_id,
        "version": chunk.version,
        "doc_key": f"{chunk.source_id}@{chunk.version}",
        "chunk_index": chunk.chunk_index,
        "collection": chunk.collection,
        "status": chunk.status,
        "acl": list(chunk.acl),
        "content_hash": chunk.content_hash,
        "metadata": dict(chunk.metadata),
        "title": chunk.title,
        "breadcrumb": chunk.breadcrumb,
        "text": chunk.text,
        "parent_text": chunk.parent_text,
        "search_text": chunk.search_text,
    }
    if chunk.vector is not None:
        doc["vector"] = vector_json(chunk.vector)
    if chunk.latin_vector is not None:
        doc[VectorField.LATIN.value] = vector_json(chunk.latin_vector)
    if chunk.rerank_states is not None:
        doc["rerank_states"] = base64.b64encode(chunk.rerank_states).decode("ascii")
        doc["rerank_states_key"] = chunk.rerank_states_key
    return doc


def states_from_docs(docs: Sequence[Mapping[str, Any]], wanted: Mapping[str, str], states_key: str) -> dict[str, bytes]:
    """Passage states out of ``mget`` docs (``STATES_SOURCE_INCLUDES``): only those written
    with ``states_key`` for a chunk whose content hash is still ``wanted[chunk_id]``."""
    out: dict[str, bytes] = {}
    for d in docs:
        src = d.get("_source") or {}
        if (d.get("found") and src.get("rerank_states") and src.get("rerank_states_key") == states_key
                and wanted.get(d["_id"]) == src.get("content_hash")):
            out[d["_id"]] = base64.b64decode(src["rerank_states"])
    return out


def _vector_of(source: Mapping[str, Any], field: VectorField) -> Vector | None:
    raw = source.get(field.value)
    return np.asarray(raw, dtype=np.float32) if raw is not None else None


def doc_to_chunk(source: Mapping[str, Any]) -> ChunkRecord:
    metadata = source.get("metadata") or {}
    return ChunkRecord(
        chunk_id=source["chunk_id"],
        source_id=source["source_id"],
        version=source["version"],
        chunk_index=int(source.get("chunk_index", 0)),
        collection=source.get("collection", ""),
        status=source.get("status", ""),
        title=source.get("title", ""),
        breadcrumb=source.get("breadcrumb", ""),
        text=source.get("text", ""),
        parent_text=source.get("parent_text", ""),
        search_text=source.get("search_text", ""),
        acl=tuple(source.get("acl") or ()),
        metadata={str(k): str(v) for k, v in _flatten(metadata).items()},
        content_hash=source.get("content_hash", ""),
        vector=_vector_of(source, VectorField.PRIMARY),
        latin_vector=_vector_of(source, VectorField.LATIN),
    )


def _flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Undo OpenSearch's object expansion of dotted keys in ``_source`` (it keeps the
    original JSON, so this only matters if a caller sent nested objects)."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


# -- queries ---------------------------------------------------------------------------------


def timeout_param(timeout_s: float) -> str:
    """Search ``timeout`` in whole milliseconds (at least 1ms)."""
    return f"{max(1, int(timeout_s * 1000))}ms"


def server_timeout_s(budget_s: float) -> float:
    """The search ``timeout`` sent for a caller budget of ``budget_s``.

    OpenSearch checks its search timeout against a cached clock (``thread_pool.
    estimated_time_interval``, 200ms by default): measured on 3.6, a slow query with
    ``timeout: 1000ms`` answered ``timed_out: true`` after 1.22s, with 100ms after 0.35s.
    Asking for less than the budget lets that partial answer arrive before the client gives
    up, so the pipeline gets the partial hits instead of a bare timeout.
    """
    return max(0.001, budget_s - min(0.3, budget_s / 3))


def filter_clauses(flt: SearchFilter) -> list[JSON]:
    """Filters as bool ``filter`` clauses; they run inside the query, before ranking."""
    clauses: list[JSON] = []
    if flt.collections:
        clauses.append({"terms": {"collection": list(flt.collections)}})
    if flt.source_ids:
        clauses.append({"terms": {"source_id": list(flt.source_ids)}})
    for key, value in sorted(flt.metadata.items()):
        clauses.append({"term": {f"metadata.{key}": value}})
    if flt.acl_groups is not None:
        should: list[JSON] = [{"bool": {"must_not": [{"exists": {"field": "acl"}}]}}]
        if flt.acl_groups:
            should.append({"terms": {"acl": list(flt.acl_groups)}})
        clauses.append({"bool": {"should": should, "minimum_should_match": 1}})
    return clauses


def bm25_body(query: str, k: int, flt: SearchFilter, timeout_s: float) -> JSON:
    """``match`` on ``search_text`` (OR of the analysed terms), filters in ``bool.filter``.
    ``timeout_s`` is the server-side search timeout (see ``server_timeout_s``)."""
    bool_query: JSON = {"must": [{"match": {"search_text": {"query": query}}}]}
    clauses = filter_clauses(flt)
    if clauses:
        bool_query["filter"] = clauses
    return {
        "query": {"bool": bool_query},
        "size": k,
        "timeout": timeout_param(timeout_s),
        "track_total_hits": False,
        "_source": {"excludes": HIT_SOURCE_EXCLUDES},
    }


def num_candidates(k: int) -> int:
    """HNSW candidate list (lucene uses the knn ``k`` as its ef): wider than k for recall,
    bounded so one query cannot explode."""
    return min(max(4 * k, 100), 10_000)


def knn_body(vector: Vector, k: int, flt: SearchFilter, timeout_s: float,
             field: VectorField = VectorField.PRIMARY) -> JSON:
    """lucene kNN with the filter inside the knn clause (efficient filtering: the filter
    restricts the HNSW walk, falling back to exact search when it is very selective)."""
    knn: JSON = {"vector": vector_json(vector), "k": num_candidates(k)}
    clauses = filter_clauses(flt)
    if clauses:
        knn["filter"] = {"bool": {"filter": clauses}}
    return {
        "query": {"knn": {field.value: knn}},
        "size": k,
        "timeout": timeout_param(timeout_s),
        "track_total_hits": False,
        "_source": {"excludes": HIT_SOURCE_EXCLUDES},
    }


def l2_distance(score: float) -> float:
    """Invert the lucene l2 score ``1 / (1 + d^2)`` back to the distance ``d``."""
    if score <= 0:
        return math.inf
    return math.sqrt(max(0.0, 1.0 / score - 1.0))


def doc_filter(source_id: str, version: str | None) -> JSON:
    clauses: list[JSON] = [{"term": {"source_id": source_id}}]
    if version is not None:
        clauses.append({"term": {"version": version}})
    return {"bool": {"filter": clauses}}


def stale_chunks_query(source_id: str, version: str, keep_ids: Sequence[str]) -> JSON:
    """Chunks of one source version that are not in the new set."""
    query = doc_filter(source_id, version)
    if keep_ids:
        query["bool"]["must_not"] = [{"ids": {"values": list(keep_ids)}}]
    return {"query": query}


def versions_body(source_id: str, max_versions: int = 1000) -> JSON:
    """Distinct versions stored for one source (any status)."""
    return {
        "size": 0,
        "query": doc_filter(source_id, None),
        "aggs": {"versions": {"terms": {"field": "version", "size": max_versions}}},
    }


def document_hash_body(source_id: str, version: str) -> JSON:
    """Distinct content hashes of one source version: one means a consistent document;
    several mean an interrupted replace, which must read as "not indexed"."""
    return {
        "size": 0,
        "query": doc_filter(source_id, version),
        "aggs": {"hashes": {"terms": {"field": "content_hash", "size": 2}}},
    }
