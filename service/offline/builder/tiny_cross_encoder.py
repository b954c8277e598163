"""A small random-weight BERT cross-encoder for tests: exercises the real ONNX
cross-encoder runner (tokenizer pair template, truncation, padding, onnxruntime) without
trained weights, which no registry package ships. Reuses the embedder's graph writer."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import onnx
from tokenizers import Tokenizer, processors

from service.offline.builder.bert_graph import LOGITS_OUTPUT, GraphOptions, build_bert_graph
from service.offline.builder.q4bin import F32, BertConfig, BertWeights, LayerWeights
from service.models.manifest import MODEL_FILE, TOKENIZER_FILE, sha256_file, write_manifest

TINY_MAX_LENGTH = 128


def _random_weights(config: BertConfig, rng: np.random.Generator) -> BertWeights:
    h, ff = config.hidden, config.intermediate

    def w(*shape: int) -> F32:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def ones() -> F32:
        return np.ones(h, dtype=np.float32)

    layers = [
        LayerWeights(
            w(h, h), w(h), w(h, h), w(h), w(h, h), w(h), w(h, h), w(h), ones(), w(h),
            w(h, ff), w(ff), w(ff, h), w(h), ones(), w(h),
        )
        for _ in range(config.layers)
    ]
    return BertWeights(
        word=w(config.vocab_size, h),
        position=w(config.max_positions, h),
        token_type=w(config.type_vocab_size, h),
        emb_ln_w=ones(),
        emb_ln_b=w(h),
        layers=layers,
    )


def _cls_sep(tok: Tokenizer) -> tuple[str, str]:
    for cls, sep in (("[CLS]", "[SEP]"), ("<s>", "</s>")):
        if tok.token_to_id(cls) is not None and tok.token_to_id(sep) is not None:
            return cls, sep
    raise ValueError("tokenizer has neither [CLS]/[SEP] nor <s>/</s>")


def build_tiny_cross_encoder(out_dir: Path, tokenizer_json: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """Write ``out_dir/{model.onnx,tokenizer.json,manifest.json}``; returns ``out_dir``.

    The tokenizer is the given one with its pair template rewritten to
    ``CLS q SEP p SEP`` (type ids 0 / 1), the layout the cross-encoder runner assumes."""
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer_json))
    cls, sep = _cls_sep(tok)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    config = BertConfig(
        hidden=hidden,
        layers=layers,
        heads=max(1, hidden // 32),
        intermediate=4 * hidden,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        max_positions=TINY_MAX_LENGTH,
        type_vocab_size=2,
        eps=1e-12,
    )
    rng = np.random.default_rng(seed)
    weights = _random_weights(config, rng)
    options = GraphOptions(
        head="cls_logit",
        token_type_input=True,
        classifier_w=(rng.standard_normal((hidden, 1)) * 0.5).astype(np.float32),
        classifier_b=np.zeros(1, dtype=np.float32),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(build_bert_graph(config, weights, options, "tiny-cross-encoder"), str(out_dir / MODEL_FILE))
    tok.save(str(out_dir / TOKENIZER_FILE))
    write_manifest(
        out_dir,
        {
            "model_id": f"tiny-cross-encoder-l{layers}-h{hidden}-s{seed}",
            "kind": "cross-encoder",
            "precision": "fp32",
            "source": {"random_seed": seed, "tokenizer_sha256": sha256_file(tokenizer_json)},
            "onnx_sha256": sha256_file(out_dir / MODEL_FILE),
            "max_length": TINY_MAX_LENGTH,
            "output": LOGITS_OUTPUT,
            "config": dataclasses.asdict(config),
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.perf_counter() - t0, 1),
        },
    )
    return out_dir


def build_tiny_split_cross_encoder(out_dir: Path, tokenizer_json: Path, lower: int = 1, upper: int = 1, hidden: int = 64,
                                   seed: int = 0, cross_bias: float = -6.0, head_scale: float = 20.0,
                                   query_max_tokens: int = 16, passage_max_tokens: int = 48,
                                   with_states: bool = True, scoring: str = "joint") -> Path:
    """A random-weight split cross-encoder (``split_graph.py``) with the trained reranker's
    manifest layout, for tests of the runner, the graph and the reranker resolution; with
    ``with_states`` also its two-graph layout (``lower.onnx`` + ``joint.onnx``) and its towers
    (``tower.onnx`` + head), as built; ``scoring``: the manifest's (README "Two towers")."""
    from service.models.towers import TOWER_HEAD_FILE, save_tower_head
    from service.offline.builder.reranker import JOINT_FILE, LOWER_FILE, TOWER_FILE
    from service.offline.builder.split_graph import SplitHead, build_split_graph

    tok = Tokenizer.from_file(str(tokenizer_json))
    config = BertConfig(hidden=hidden, layers=lower + upper, heads=max(1, hidden // 32), intermediate=4 * hidden,
                        vocab_size=tok.get_vocab_size(with_added_tokens=True), max_positions=TINY_MAX_LENGTH,
                        type_vocab_size=1, eps=1e-12)
    weights = _random_weights(config, np.random.default_rng(seed))
    lower_w = dataclasses.replace(weights, layers=weights.layers[:lower])
    head = SplitHead([np.full(config.heads, cross_bias, np.float32) for _ in range(upper)],
                     np.full(hidden, head_scale, np.float32), 0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(build_split_graph(config, lower_w, weights.layers[lower:], head, False, "tiny-split"), str(out_dir / MODEL_FILE))
    states: dict[str, str] = {}
    if with_states:
        for part, file in (("lower", LOWER_FILE), ("joint", JOINT_FILE), ("tower", TOWER_FILE)):
            graph = build_split_graph(config, lower_w, weights.layers[lower:], head, False, f"tiny-split-{part}", part)  # type: ignore[arg-type]
            onnx.save(graph, str(out_dir / file))
            states[f"{part}_onnx_sha256"] = sha256_file(out_dir / file)
        save_tower_head(out_dir / TOWER_HEAD_FILE, head.w, head.b)
        states.update(lower_file=LOWER_FILE, joint_file=JOINT_FILE, tower_file=TOWER_FILE, tower_head_file=TOWER_HEAD_FILE)
    tok.save(str(out_dir / TOKENIZER_FILE))
    write_manifest(out_dir, {
        "model_id": f"tiny-split-cross-encoder-l{lower}+{upper}-h{hidden}-s{seed}",
        "kind": "cross-encoder",
        "architecture": "split",
        "precision": "fp32",
        "max_length": passage_max_tokens,
        "query_max_tokens": query_max_tokens,
        "passage_max_tokens": passage_max_tokens,
        "query_prefix": "query:",
        "passage_prefix": "passage:",
        "lower_layers": lower,
        "upper_layers": upper,
        "source": {"random_seed": seed, "tokenizer_sha256": sha256_file(tokenizer_json)},
        "onnx_sha256": sha256_file(out_dir / MODEL_FILE),
        **({"states": states, "scoring": scoring} if states else {}),
        "config": dataclasses.asdict(config),
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    return out_dir
