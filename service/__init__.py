"""Evidence retrieval backend: gRPC transport over a hybrid BM25 + kNN + rerank pipeline."""

__version__ = "0.1.0"
