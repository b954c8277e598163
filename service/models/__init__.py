"""Model runtime: tokenizers + onnxruntime backends, the executor pool and micro-batcher,
and the builder that turns weights shipped in registry packages into ONNX files."""
