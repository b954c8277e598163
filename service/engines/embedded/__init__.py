"""The embedded engine: in-process BM25 (a port of OpenSearch's ``cjk`` analyzer and Lucene
scoring) plus exact kNN, persisted in SQLite under a data directory."""

from service.engines.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
