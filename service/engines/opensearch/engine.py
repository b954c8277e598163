"""``OpenSearchEngine``: the production engine, over opensearch-py's ``AsyncOpenSearch``.

One client (one aiohttp connection pool) per engine, and one engine per process. The index
layout, documents and query bodies live in ``mapping``; this module does the I/O and turns
OpenSearch's answers into the engine contract of ``base``:

- ``timed_out: true`` or ``_shards.failed > 0`` in a 200 answer -> ``SearchResponse(
  complete=False)`` with whatever hits came back (never "no hits");
- the client gave up waiting (``ConnectionTimeout``, or our own deadline) -> ``EngineTimeout``;
- refused/reset connections, 5xx, 429 on a search, a missing index -> ``EngineUnavailable``.

Every search sends an explicit ``timeout`` a little under the caller's budget (OpenSearch
overshoots it by up to ~250ms, see ``mapping.server_timeout_s``) and the client waits only a
small margin past the budget, so a hung node costs the caller ``timeout_s`` plus that margin.
The client never retries by itself (``max_retries=0``): a retry would silently double the
caller's wait. Bulk writes retry 429s with bounded exponential backoff instead.

Nothing here fails when OpenSearch is down: the template, index and alias are created on the
first successful contact (``start``, ``ready`` or any call), and the same engine object
recovers when the node comes back.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import numpy as np
from opensearchpy import AsyncOpenSearch
from opensearchpy.exceptions import (
    ConnectionError as OSConnectionError,
)
from opensearchpy.exceptions import ConnectionTimeout, NotFoundError, TransportError

from service.engines.base import (
    ChunkRecord,
    Engine,
    EngineError,
    EngineStats,
    EngineTimeout,
    EngineUnavailable,
    Hit,
    PartialReason,
    SearchFilter,
    SearchResponse,
    Vector,
    VectorField,
    WriteError,
    WriteReport,
)
from service.engines.opensearch import mapping

log = logging.getLogger(__name__)

T = TypeVar("T")
JSON = dict[str, Any]

# Seconds a writer waits for the periodic refresh (index default 1s) before trusting that its
# previous writes are searchable; inside this window a replace refreshes first.
_REFRESH_WINDOW_S = 1.5
_BULK_RETRIES = 5
_BULK_BACKOFF_S = 0.05
_READY_TIMEOUT_S = 1.0


def client_margin(timeout_s: float) -> float:
    """How much longer than the caller's budget the client waits before ``EngineTimeout``:
    a little slack for the answer to travel, small next to the budget."""
    return min(0.5, max(0.05, 0.1 * timeout_s))


def _status(exc: TransportError) -> int | None:
    code = exc.status_code
    return code if isinstance(code, int) else None


class OpenSearchEngine(Engine):
    name = "opensearch"

    def __init__(
        self,
        url: str,
        index_prefix: str = "retrieval",
        dimension: int = 384,
        latin_dimension: int | None = None,
        shards: int = 1,
        replicas: int = 0,
        request_timeout_s: float = 10.0,
        pool_size: int = 32,
    ) -> None:
        self.url = url
        self.prefix = index_prefix
        self.dimension = dimension
        # The Latin-script embedder's dimension; None: no such embedder is served (the
        # field is still mapped, at ``dimension``, so turning one on needs no reindex).
        self.latin_dimension = latin_dimension
        self.shards = shards
        self.replicas = replicas
        self.request_timeout_s = request_timeout_s
        self.alias = mapping.alias_name(index_prefix)
        self._client = AsyncOpenSearch(
            hosts=[url],
            max_retries=0,
            retry_on_timeout=False,
            timeout=request_timeout_s,
            maxsize=pool_size,
            http_compress=False,
        )
        self._index_ok = False
        self._index_lock = asyncio.Lock()
        self._closed = False
        self._recent_writes: dict[tuple[str, str], float] = {}

    # -- plumbing ---------------------------------------------------------------------------

    async def _request(self, call: Awaitable[T], what: str, timeout_s: float) -> T:
        """Await one client call under a hard deadline, mapping failures to the contract."""
        if self._closed:
            if asyncio.iscoroutine(call):
                call.close()
            raise EngineUnavailable("opensearch engine is closed")
        try:
            return await asyncio.wait_for(call, timeout_s)
        except TimeoutError as exc:
            raise EngineTimeout(f"opensearch {what}: no answer within {timeout_s:.3f}s") from exc
        except ConnectionTimeout as exc:
            raise EngineTimeout(f"opensearch {what}: client timeout ({exc.info})") from exc
        except OSConnectionError as exc:
            raise EngineUnavailable(f"opensearch {what}: unreachable ({exc.info})") from exc
        except NotFoundError as exc:
            self._index_ok = False  # someone deleted it: recreate on next contact
            raise EngineUnavailable(f"opensearch {what}: not found ({exc.error})") from exc
        except TransportError as exc:
            raise EngineUnavailable(
                f"opensearch {what}: HTTP {exc.status_code} {exc.error}: {_reason(exc)}"
            ) from exc

    async def _ensure_index(self, timeout_s: float | None = None) -> None:
        """Create template, first index generation and alias once; cheap afterwards."""
        if self._index_ok:
            return
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        async with self._index_lock:
            if self._index_ok:
                return
            client = self._client
            exists = await self._request(
                client.indices.exists_alias(name=self.alias, request_timeout=timeout),
                "alias check",
                timeout,
            )
            if not exists:
                template = self._template()
                await self._request(
                    client.indices.put_index_template(
                        name=mapping.template_name(self.prefix),
                        body=template,
                        request_timeout=timeout,
                    ),
                    "put template",
                    timeout,
                )
                try:
                    await self._request(
                        client.indices.create(
                            index=mapping.index_name(self.prefix, mapping.MAPPING_VERSION),
                            body=mapping.create_index_body(self.prefix),
                            params={"wait_for_active_shards": "1"},
                            request_timeout=timeout,
                        ),
                        "create index",
                        timeout,
                    )
                except EngineUnavailable as exc:
                    # Another process won the race: fine as long as the alias is there now.
                    if "resource_already_exists" not in str(exc):
                        raise
            mappings = await self._request(
                client.indices.get_mapping(index=self.alias, request_timeout=timeout),
                "get mapping",
                timeout,
            )
            expected = ((VectorField.PRIMARY, self.dimension), (VectorField.LATIN, self.latin_dimension))
            for field, want in expected:
                dim = mapping.mapped_dimension(mappings, field)
                if want is not None and dim is not None and dim != want:
                    raise EngineUnavailable(
                        f"index {self.alias} has {field.value} dimension {dim}, engine expects "
                        f"{want}: reindex with the new model first"
                    )
            added = await self._add_fields(mappings, "rerank_states", mapping.STATES_PROPERTIES, timeout)
            latin = mapping.latin_vector_properties(self.dimension_of(VectorField.LATIN))
            added |= await self._add_fields(mappings, VectorField.LATIN.value, latin, timeout)
            if added:  # and to the template, so a reindex's next generation has them too
                await self._request(
                    self._client.indices.put_index_template(name=mapping.template_name(self.prefix),
                                                            body=self._template(), request_timeout=timeout),
                    "put template", timeout)
            self._index_ok = True

    def dimension_of(self, field: VectorField) -> int:
        """The dimension ``field`` is mapped at (the Latin-script field: at the primary's
        where no Latin-script embedder is served)."""
        if field is VectorField.LATIN and self.latin_dimension is not None:
            return self.latin_dimension
        return self.dimension

    def _template(self) -> JSON:
        return mapping.index_template(self.prefix, self.dimension, self.shards, self.replicas, self.latin_dimension)

    async def _add_fields(self, mappings: JSON, marker: str, properties: JSON, timeout: float) -> bool:
        """An index made before a field (the passage states, the Latin-script vector) lacks
        it, and its ``dynamic: strict`` mapping would refuse it: add ``properties`` in place
        (an additive mapping update) where ``marker`` is missing. True when it added any."""
        missing = [idx for idx, body in mappings.items()
                   if marker not in body.get("mappings", {}).get("properties", {})]
        if not missing:
            return False
        await self._request(
            self._client.indices.put_mapping(index=",".join(missing), body={"properties": properties},
                                             request_timeout=timeout),
            f"put mapping ({marker})", timeout)
        return True

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Try to set the index up; a down node is logged, not raised (see ``ready``)."""
        try:
            await self._ensure_index(timeout_s=min(self.request_timeout_s, 5.0))
        except EngineError as exc:
            log.warning("opensearch not ready at start (%s); will retry lazily", exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._client.close()

    async def ready(self) -> bool:
        """Cluster answers its health API and the alias exists (created if missing)."""
        if self._closed:
            return False
        try:
            health = await self._request(
                self._client.cluster.health(
                    params={"timeout": "1s"}, request_timeout=_READY_TIMEOUT_S
                ),
                "health",
                _READY_TIMEOUT_S + 0.1,
            )
            if health.get("status") not in ("green", "yellow"):
                return False
            await self._ensure_index(timeout_s=_READY_TIMEOUT_S)
            return True
        except EngineError:
            return False
        except Exception:  # ready() is a probe: it reports, it never raises
            log.exception("opensearch readiness probe failed unexpectedly")
            return False

    # -- writes -----------------------------------------------------------------------------

    async def document_hash(self, source_id: str, version: str) -> str | None:
        """The content hash if every searchable chunk of this version carries the same one;
        None when absent or inconsistent (an interrupted replace must be redone)."""
        await self._ensure_index()
        resp = await self._request(
            self._client.search(
                index=self.alias,
                body=mapping.document_hash_body(source_id, version),
                request_timeout=self.request_timeout_s,
            ),
            "document hash",
            self.request_timeout_s + 0.5,
        )
        buckets = resp.get("aggregations", {}).get("hashes", {}).get("buckets", [])
        if len(buckets) != 1:
            return None
        return str(buckets[0]["key"])

    async def versions(self, source_id: str) -> list[str]:
        await self._ensure_index()
        resp = await self._request(
            self._client.search(
                index=self.alias,
                body=mapping.versions_body(source_id),
                request_timeout=self.request_timeout_s,
            ),
            "versions",
            self.request_timeout_s + 0.5,
        )
        buckets = resp.get("aggregations", {}).get("versions", {}).get("buckets", [])
        return sorted(str(b["key"]) for b in buckets)

    def _invalid(
        self, source_id: str, version: str, chunks: Sequence[ChunkRecord]
    ) -> list[WriteError]:
        errors: list[WriteError] = []
        seen: set[str] = set()
        for c in chunks:
            problem = None
            if (c.source_id, c.version) != (source_id, version):
                problem = f"chunk belongs to {c.source_id}@{c.version}, not {source_id}@{version}"
            elif c.chunk_id in seen:
                problem = "duplicate chunk_id in batch"
            else:
                problem = mapping.vector_problem(c.vector, self.dimension) or mapping.vector_problem(
                    c.latin_vector, self.dimension_of(VectorField.LATIN))
            seen.add(c.chunk_id)
            if problem:
                errors.append(WriteError(chunk_id=c.chunk_id, message=problem))
        return errors

    async def _foreign_owners(
        self, source_id: str, version: str, ids: list[str]
    ) -> list[WriteError]:
        """Chunk ids already used by another document (realtime ``mget``, so unrefreshed
        writes count): overwriting them would silently move a chunk between documents."""
        if not ids:
            return []
        resp = await self._request(
            self._client.mget(
                index=self.alias,
                body={"ids": ids},
                params={"_source_includes": "source_id,version"},
                request_timeout=self.request_timeout_s,
            ),
            "mget",
            self.request_timeout_s + 0.5,
        )
        errors = []
        for doc in resp.get("docs", []):
            src = doc.get("_source")
            if doc.get("found") and src and (src["source_id"], src["version"]) != (
                source_id,
                version,
            ):
                errors.append(
                    WriteError(
                        chunk_id=doc["_id"],
                        message=f"chunk_id already used by {src['source_id']}@{src['version']}",
                    )
                )
        return errors

    async def _bulk(self, ops: list[tuple[str, JSON | None]]) -> list[WriteError]:
        """Run ``(chunk_id, doc or None=delete)`` operations; retry only the items (or the
        whole request) rejected with 429, with bounded exponential backoff. Every other
        per-item failure is returned, never dropped."""
        pending = ops
        errors: list[WriteError] = []
        for attempt in range(_BULK_RETRIES + 1):
            lines: list[JSON] = []
            for chunk_id, doc in pending:
                if doc is None:
                    lines.append({"delete": {"_index": self.alias, "_id": chunk_id}})
                else:
                    lines.append({"index": {"_index": self.alias, "_id": chunk_id}})
                    lines.append(doc)
            try:
                resp = await self._request(
                    self._client.bulk(
                        body=lines,
                        params={"refresh": "false"},
                        request_timeout=self.request_timeout_s,
                    ),
                    "bulk",
                    self.request_timeout_s + 0.5,
                )
            except EngineUnavailable as exc:
                cause = exc.__cause__
                if (
                    isinstance(cause, TransportError)
                    and _status(cause) == 429
                    and attempt < _BULK_RETRIES
                ):
                    await asyncio.sleep(_BULK_BACKOFF_S * 2**attempt)
                    continue
                raise
            retry: list[tuple[str, JSON | None]] = []
            for (chunk_id, doc), item in zip(pending, resp.get("items", []), strict=True):
                result = next(iter(item.values()))
                status = int(result.get("status", 500))
                if status < 300 or (doc is None and status == 404):
                    continue
                if status == 429 and attempt < _BULK_RETRIES:
                    retry.append((chunk_id, doc))
                    continue
                err = result.get("error") or {}
                reason = err.get("reason", "") if isinstance(err, dict) else str(err)
                kind = err.get("type", "") if isinstance(err, dict) else ""
                errors.append(WriteError(chunk_id=chunk_id, message=f"{status} {kind}: {reason}"))
            if not retry:
                return errors
            pending = retry
            await asyncio.sleep(_BULK_BACKOFF_S * 2**attempt)
        return errors  # pragma: no cover - the loop always returns

    async def replace_document(
        self, source_id: str, version: str, chunks: Sequence[ChunkRecord]
    ) -> WriteReport:
        """Index the new chunks (ids = chunk ids, so re-ingest is idempotent), then delete
        the version's chunks that are not in the new set.

        Invalid batches are refused whole (nothing written), like the embedded engine. If
        some bulk items fail, the stale chunks are kept and the errors returned: the mixed
        content hashes make ``document_hash`` report None, so the ingest redoes the version.
        """
        chunks = list(chunks)
        await self._ensure_index()
        errors = self._invalid(source_id, version, chunks)
        if not errors:
            errors = await self._foreign_owners(source_id, version, [c.chunk_id for c in chunks])
        if errors:
            return WriteReport(written=0, errors=errors)
        key = (source_id, version)
        written_before = self._recent_writes.get(key)
        errors = await self._bulk([(c.chunk_id, mapping.chunk_to_doc(c)) for c in chunks])
        self._recent_writes[key] = time.monotonic()
        self._forget_old_writes()
        if errors:
            return WriteReport(written=len(chunks) - len(errors), errors=errors)
        # delete_by_query only sees searchable docs: if this process wrote the version a
        # moment ago, make that write visible first so its stale chunks are found.
        if written_before is not None and time.monotonic() - written_before < _REFRESH_WINDOW_S:
            await self.refresh()
        await self._delete_by_query(
            mapping.stale_chunks_query(source_id, version, [c.chunk_id for c in chunks])
        )
        return WriteReport(written=len(chunks))

    def _forget_old_writes(self) -> None:
        if len(self._recent_writes) < 1024:
            return
        horizon = time.monotonic() - _REFRESH_WINDOW_S
        self._recent_writes = {k: t for k, t in self._recent_writes.items() if t >= horizon}

    async def _delete_by_query(self, body: JSON, refresh: bool = False) -> int:
        resp = await self._request(
            self._client.delete_by_query(
                index=self.alias,
                body=body,
                params={
                    "conflicts": "proceed",
                    "refresh": "true" if refresh else "false",
                    "slices": "1",
                },
                request_timeout=self.request_timeout_s,
            ),
            "delete by query",
            self.request_timeout_s + 0.5,
        )
        failures = resp.get("failures") or []
        if failures:
            raise EngineUnavailable(f"opensearch delete by query failed: {failures[:3]}")
        return int(resp.get("deleted", 0))

    async def delete_document(self, source_id: str, version: str | None = None) -> int:
        """Refresh first (delete_by_query sees only searchable chunks) and after (a retired
        version must disappear from searches now, not at the next periodic refresh)."""
        await self._ensure_index()
        await self.refresh()
        query = {"query": mapping.doc_filter(source_id, version)}
        deleted = await self._delete_by_query(query, refresh=True)
        for key in [k for k in self._recent_writes if k[0] == source_id]:
            if version is None or key[1] == version:
                del self._recent_writes[key]
        return deleted

    async def refresh(self) -> None:
        await self._ensure_index()
        await self._request(
            self._client.indices.refresh(
                index=self.alias, request_timeout=self.request_timeout_s
            ),
            "refresh",
            self.request_timeout_s + 0.5,
        )

    # -- reads ------------------------------------------------------------------------------

    async def _search(self, body: JSON, timeout_s: float, what: str) -> SearchResponse:
        started = time.perf_counter()
        margin = client_margin(timeout_s)
        deadline = time.perf_counter() + timeout_s + margin

        async def run() -> JSON:
            await self._ensure_index(timeout_s=timeout_s)
            params: dict[str, str] = {"allow_partial_search_results": "true"}
            if self.shards > 1 and what == "bm25":
                # Global term statistics, so BM25 scores do not depend on shard routing.
                params["search_type"] = "dfs_query_then_fetch"
            remaining = max(0.001, deadline - time.perf_counter())
            result: JSON = await self._client.search(
                index=self.alias, body=body, params=params, request_timeout=remaining
            )
            return result

        resp = await self._request(run(), what, timeout_s + margin)
        hits = []
        for raw in resp.get("hits", {}).get("hits", []):
            score = float(raw.get("_score") or 0.0)
            chunk = mapping.doc_to_chunk(raw["_source"])
            distance = mapping.l2_distance(score) if what == "knn" else None
            hits.append(Hit(chunk=chunk, score=score, distance=distance))
        took = float(resp.get("took", (time.perf_counter() - started) * 1000))
        shards = resp.get("_shards", {})
        failed = int(shards.get("failed", 0) or 0)
        if resp.get("timed_out"):
            detail = f"search timed out after {body['timeout']} ({len(hits)} partial hits)"
            if failed:
                detail += f"; {failed}/{shards.get('total')} shards failed"
            return SearchResponse(hits, False, PartialReason.TIMED_OUT, detail, took)
        if failed:
            reasons = [f.get("reason", {}).get("type", "?") for f in shards.get("failures", [])]
            detail = f"{failed}/{shards.get('total')} shards failed: {', '.join(reasons[:3])}"
            return SearchResponse(hits, False, PartialReason.SHARDS_FAILED, detail, took)
        return SearchResponse(hits=hits, took_ms=took)

    async def bm25(
        self, query: str, k: int, flt: SearchFilter, timeout_s: float
    ) -> SearchResponse:
        if k <= 0:
            return SearchResponse(hits=[])
        body = mapping.bm25_body(query, k, flt, mapping.server_timeout_s(timeout_s))
        return await self._search(body, timeout_s, "bm25")

    async def knn(
        self, vector: Vector, k: int, flt: SearchFilter, timeout_s: float,
        field: VectorField = VectorField.PRIMARY,
    ) -> SearchResponse:
        query = np.asarray(vector, dtype=np.float32)
        dimension = self.dimension_of(field)
        if query.shape != (dimension,):
            raise ValueError(f"query vector shape {query.shape}, index has {dimension} ({field.value})")
        if k <= 0:
            return SearchResponse(hits=[])
        body = mapping.knn_body(query, k, flt, mapping.server_timeout_s(timeout_s), field)
        return await self._search(body, timeout_s, "knn")

    async def get_chunks(self, chunk_ids: Sequence[str]) -> list[ChunkRecord]:
        """Realtime ``mget`` (sees unrefreshed writes), vectors included, order kept (the
        passage states are not: ``passage_states`` reads those)."""
        ids = list(dict.fromkeys(chunk_ids))
        if not ids:
            return []
        await self._ensure_index()
        resp = await self._request(
            self._client.mget(
                index=self.alias, body={"ids": ids}, params={"_source_excludes": "rerank_states,rerank_states_key"},
                request_timeout=self.request_timeout_s
            ),
            "mget",
            self.request_timeout_s + 0.5,
        )
        found = {
            d["_id"]: mapping.doc_to_chunk(d["_source"])
            for d in resp.get("docs", [])
            if d.get("found")
        }
        return [found[i] for i in chunk_ids if i in found]

    async def passage_states(self, chunks: Sequence[tuple[str, str]], states_key: str) -> dict[str, bytes]:
        """Realtime ``mget`` of the states fields only."""
        wanted = dict(chunks)
        if not wanted:
            return {}
        await self._ensure_index()
        resp = await self._request(
            self._client.mget(index=self.alias, body={"ids": list(wanted)},
                              params={"_source_includes": mapping.STATES_SOURCE_INCLUDES},
                              request_timeout=self.request_timeout_s),
            "mget",
            self.request_timeout_s + 0.5,
        )
        return mapping.states_from_docs(resp.get("docs", []), wanted, states_key)

    async def put_passage_states(self, states: Sequence[tuple[str, str, bytes]], states_key: str) -> int:
        """One bulk of scripted partial updates, each a no-op unless the chunk still has that
        content hash (a missing chunk answers 404: nothing is created). Costs a reindex of
        each chunk's document inside OpenSearch (an update rewrites the whole document), so
        on this engine states computed at ingest are the cheaper way to keep them."""
        items = list(states)
        if not items:
            return 0
        await self._ensure_index()
        lines: list[JSON] = []
        for chunk_id, content_hash, blob in items:
            lines.append({"update": {"_index": self.alias, "_id": chunk_id}})
            lines.append({"script": {"lang": "painless", "source": mapping.PUT_STATES_SCRIPT, "params": {
                "content_hash": content_hash, "key": states_key,
                "states": base64.b64encode(blob).decode("ascii")}}})
        resp = await self._request(
            self._client.bulk(body=lines, params={"refresh": "false"}, request_timeout=self.request_timeout_s),
            "bulk", self.request_timeout_s + 0.5,
        )
        return sum(1 for item in resp.get("items", [])
                   if next(iter(item.values())).get("result") == "updated")

    async def chunks_without(self, field: VectorField, after: str, limit: int) -> list[tuple[str, str, str]]:
        """One page of a search for chunks without the field (``exists``), sorted by the
        ``chunk_id`` keyword and paged with ``search_after``. Realtime enough: a refresh first."""
        await self._ensure_index()
        await self.refresh()
        page = await self._page_by_chunk_id({"bool": {"must_not": [{"exists": {"field": field.value}}]}},
                                            ["chunk_id", "content_hash", "search_text"], after, limit)
        return [(d["chunk_id"], d["content_hash"], d["search_text"]) for d in page]

    async def chunks_without_states(self, states_key: str, after: str, limit: int
                                    ) -> tuple[list[tuple[str, str, str]], str | None]:
        """One page of every chunk by the ``chunk_id`` keyword (``search_after``), with the
        states key but not the states; the filter is ours, the key being stored, not indexed
        (states and key are written together, and a re-ingest rewrites both)."""
        await self._ensure_index()
        page = await self._page_by_chunk_id({"match_all": {}},
                                            ["chunk_id", "content_hash", "search_text", "rerank_states_key"], after, limit)
        rows = [(d["chunk_id"], d["content_hash"], d["search_text"]) for d in page
                if d.get("rerank_states_key") != states_key]
        return rows, (page[-1]["chunk_id"] if len(page) == limit else None)

    async def _page_by_chunk_id(self, query: JSON, source: list[str], after: str, limit: int) -> list[JSON]:
        """The ``_source`` fields of up to ``limit`` chunks ``query`` matches, sorted by the
        ``chunk_id`` keyword, after ``after`` (``search_after``; "" = from the start)."""
        body: JSON = {"size": limit, "query": query, "sort": [{"chunk_id": "asc"}], "_source": source}
        if after:
            body["search_after"] = [after]
        resp = await self._request(
            self._client.search(index=self.alias, body=body, request_timeout=self.request_timeout_s),
            "search", self.request_timeout_s + 0.5,
        )
        return [h["_source"] for h in resp.get("hits", {}).get("hits", [])]

    async def put_vectors(self, field: VectorField, vectors: Sequence[tuple[str, str, Vector]]) -> int:
        """One bulk of scripted partial updates, each a no-op unless the chunk still has that
        content hash and no such vector (a missing chunk answers 404: nothing is created). A
        vector of another dimension than the field's mapping is left out before it is sent."""
        dimension = self.dimension_of(field)
        items = [(cid, h, np.asarray(v, dtype=np.float32)) for cid, h, v in vectors]
        items = [(cid, h, v) for cid, h, v in items
                 if v.ndim == 1 and len(v) == dimension and bool(np.all(np.isfinite(v)))]
        if not items:
            return 0
        await self._ensure_index()
        lines: list[JSON] = []
        for chunk_id, content_hash, vector in items:
            lines.append({"update": {"_index": self.alias, "_id": chunk_id}})
            lines.append({"script": {"lang": "painless", "source": mapping.PUT_VECTOR_SCRIPT, "params": {
                "content_hash": content_hash, "field": field.value, "vector": mapping.vector_json(vector)}}})
        resp = await self._request(
            self._client.bulk(body=lines, params={"refresh": "false"}, request_timeout=self.request_timeout_s),
            "bulk", self.request_timeout_s + 0.5,
        )
        return sum(1 for item in resp.get("items", [])
                   if next(iter(item.values())).get("result") == "updated")

    async def stats(self) -> EngineStats:
        """Counts of searchable chunks and documents (exact: composite aggregation pages)."""
        await self._ensure_index()
        timeout = self.request_timeout_s
        count = await self._request(
            self._client.count(index=self.alias, request_timeout=timeout),
            "count",
            timeout + 0.5,
        )
        documents = 0
        after: JSON | None = None
        while True:
            composite: JSON = {"size": 10_000, "sources": [{"d": {"terms": {"field": "doc_key"}}}]}
            if after:
                composite["after"] = after
            resp = await self._request(
                self._client.search(
                    index=self.alias,
                    body={"size": 0, "aggs": {"docs": {"composite": composite}}},
                    request_timeout=timeout,
                ),
                "stats",
                timeout + 0.5,
            )
            agg = resp.get("aggregations", {}).get("docs", {})
            documents += len(agg.get("buckets", []))
            after = agg.get("after_key")
            if not after or not agg.get("buckets"):
                break
        chunk_count = int(count.get("count", 0))
        return EngineStats(
            chunk_count=chunk_count,
            document_count=documents,
            dimension=self.dimension if chunk_count else None,
        )

    # -- reindex ----------------------------------------------------------------------------

    async def current_index(self) -> str:
        """The concrete index the alias points at."""
        await self._ensure_index()
        resp = await self._request(
            self._client.indices.get_alias(name=self.alias, request_timeout=self.request_timeout_s),
            "get alias",
            self.request_timeout_s + 0.5,
        )
        return str(next(iter(resp)))

    async def reindex(self, delete_old: bool = True) -> str:
        """Copy the current generation into the next one (created from the current template,
        i.e. this engine's mapping) and swap the alias atomically. Pause ingest meanwhile:
        writes that land on the old index after the copy started are not carried over."""
        old = await self.current_index()
        generation = (mapping.index_generation(self.prefix, old) or 0) + 1
        new = mapping.index_name(self.prefix, generation)
        timeout = max(self.request_timeout_s, 600.0)
        client = self._client
        await self._request(
            client.indices.put_index_template(
                name=mapping.template_name(self.prefix),
                body=self._template(),
                request_timeout=timeout,
            ),
            "put template",
            timeout,
        )
        await self._request(
            client.indices.create(index=new, request_timeout=timeout), "create index", timeout
        )
        await self._request(
            client.reindex(
                body={"source": {"index": old}, "dest": {"index": new}},
                params={"refresh": "true", "wait_for_completion": "true"},
                request_timeout=timeout,
            ),
            "reindex",
            timeout,
        )
        await self._request(
            client.indices.update_aliases(
                body={
                    "actions": [
                        {"remove": {"index": old, "alias": self.alias}},
                        {"add": {"index": new, "alias": self.alias, "is_write_index": True}},
                    ]
                },
                request_timeout=timeout,
            ),
            "swap alias",
            timeout,
        )
        if delete_old:
            await self._request(
                client.indices.delete(index=old, request_timeout=timeout), "delete", timeout
            )
        return new

    async def drop_indices(self) -> None:
        """Delete every index and the template of this prefix (tests, teardown)."""
        timeout = self.request_timeout_s
        # Resolve names first: clusters may forbid wildcard deletes (destructive_requires_name).
        found = await self._request(
            self._client.indices.get(
                index=f"{self.prefix}-chunks-v*",
                params={"ignore_unavailable": "true", "allow_no_indices": "true"},
                request_timeout=timeout,
            ),
            "list indices",
            timeout + 0.5,
        )
        names = [n for n in found if mapping.index_generation(self.prefix, n) is not None]
        if names:
            await self._request(
                self._client.indices.delete(index=",".join(names), request_timeout=timeout),
                "delete indices",
                timeout + 0.5,
            )
        try:
            await self._request(
                self._client.indices.delete_index_template(
                    name=mapping.template_name(self.prefix), request_timeout=timeout
                ),
                "delete template",
                timeout + 0.5,
            )
        except EngineUnavailable:
            pass  # already gone
        self._index_ok = False


def _reason(exc: TransportError) -> str:
    info = exc.info
    if isinstance(info, dict):
        err = info.get("error")
        if isinstance(err, dict):
            return str(err.get("reason", err.get("type", "")))[:300]
    return str(info)[:300]


__all__ = ["OpenSearchEngine", "client_margin"]
