"""Cross-encoder reranker training: pack (mine + tokenize + compact backbone, CPU, numpy),
train (plain torch, CPU or GPU), export (ONNX fp32 + int8 with the builder's graph writer).

Training-only: serving never imports this package, and torch is only needed by
``train`` / ``export`` (the ``train`` extra). The pack and train modules import nothing from
grpc, onnxruntime or ``service.eval`` at module import time, so the trainer runs on a bare
GPU machine that only has numpy, tokenizers, onnx and torch.
"""
