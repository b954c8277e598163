"""The descriptor pool server reflection answers from: the default pool, plus method
symbols (``package.Service.Method``), which the upb-backed pool does not index. Load tools
resolve a call by its method symbol (ghz asks for ``retrieval.v1.RetrievalService.Lookup``
and gave up with "Symbol not found"); grpcurl asks for the service, which always worked."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor


class MethodAwarePool:
    def __init__(self, pool: descriptor_pool.DescriptorPool | None = None) -> None:
        self._pool = pool or descriptor_pool.Default()

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:  # noqa: N802 - the pool's API
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            if not service:
                raise
            found = self._pool.FindServiceByName(service)  # KeyError when neither exists
            if method not in found.methods_by_name:
                raise
            return found.file

    def __getattr__(self, name: str) -> Any:  # every other lookup: the pool itself
        return getattr(self._pool, name)
