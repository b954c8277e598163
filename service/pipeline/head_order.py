"""How the rerank stage orders its head: a weighted sum of min-max normalised signals.

Every reranked candidate carries up to five signals: the reranker's logit, the fused (RRF)
score, and the legs' own scores (BM25, dense cosine, and the Latin-script leg's cosine where
that leg ran). Each is min-max normalised over the head
(a leg that missed a candidate gives it the head's lowest value of that leg, i.e. 0), and
the head is sorted by ``sum(weight[f] * normalised[f])``, with one weight set for Han-script
queries and one for the rest (like the fusion settings and the quality calibration).

``alpha`` interpolation, ``alpha * rerank + (1 - alpha) * fused``, is the special case
``{"rerank": alpha, "fused": 1 - alpha}``. A reranker may ship ``rerank_order.json``: weights
fitted on InsuranceQA *train* (``python -m service.eval.head_order_fit``; README "The rerank
order"), because its logits and the legs' scores are complementary in ways one alpha cannot
express (e.g. BM25 says things the fused rank blurs). ``service eval --gate`` measures the
order the server serves and records the file's hash.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.pipeline.fusion import Candidate, minmax

FEATURES = ("rerank", "fused", "bm25", "dense", "latin_dense")
SCRIPTS = ("latin", "cjk")  # the weight sets: queries without / with Han characters
ORDER_FILE = "rerank_order.json"
ORDER_VERSION = 1


class HeadOrderError(ValueError):
    """A ``rerank_order.json`` this service cannot use (startup fails: the reranker's gate was
    measured with it, so silently ordering another way would serve an unmeasured model)."""


def normalised(values: Sequence[float | None]) -> list[float]:
    """Min-max to [0, 1] over the values present; a missing value (the leg did not return
    the candidate) counts as the lowest present; all zeros when nothing varies."""
    present = [v for v in values if v is not None]
    if not present:
        return [0.0] * len(values)
    lo = min(present)
    return minmax([lo if v is None else v for v in values])


@dataclass(frozen=True)
class HeadOrder:
    weights: Mapping[str, Mapping[str, float]]  # script -> feature -> weight
    source: str = ""  # for logs and the README: "alpha 0.7" or the file and its hash
    sha256: str | None = None  # of the file it was read from; None for an alpha
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_alpha(cls, alpha: float) -> HeadOrder:
        w = {"rerank": alpha, "fused": 1.0 - alpha}
        return cls({s: w for s in SCRIPTS}, source=f"alpha {alpha:g}")

    @classmethod
    def from_weights(cls, weights: Mapping[str, Mapping[str, float]], meta: Mapping[str, Any] | None = None) -> HeadOrder:
        for script in SCRIPTS:
            if script not in weights:
                raise HeadOrderError(f"rerank order has no weights for {script!r} queries")
        for script, w in weights.items():
            if script not in SCRIPTS:
                raise HeadOrderError(f"rerank order: unknown script {script!r} (known: {', '.join(SCRIPTS)})")
            for name, value in w.items():
                if name not in FEATURES:
                    raise HeadOrderError(f"rerank order: unknown feature {name!r} (known: {', '.join(FEATURES)})")
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise HeadOrderError(f"rerank order: weight {script}.{name} is not a finite number")
            if not w.get("rerank", 0.0) > 0:
                raise HeadOrderError(f"rerank order: {script} gives the reranker no positive weight")
        return cls({s: {f: float(v) for f, v in w.items()} for s, w in weights.items()}, meta=dict(meta or {}))

    @classmethod
    def load(cls, path: Path) -> HeadOrder:
        raw = path.read_bytes()
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise HeadOrderError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("version") != ORDER_VERSION:
            raise HeadOrderError(f"{path}: not a version-{ORDER_VERSION} rerank order")
        sha = hashlib.sha256(raw).hexdigest()
        order = cls.from_weights(doc.get("weights", {}), meta={k: v for k, v in doc.items() if k != "weights"})
        return cls(order.weights, source=f"{path.name} ({sha[:12]})", sha256=sha, meta=order.meta)

    def to_json(self, **meta: Any) -> str:
        return json.dumps({"version": ORDER_VERSION, "features": list(FEATURES), **meta,
                           "weights": {s: dict(self.weights[s]) for s in SCRIPTS}}, indent=2) + "\n"

    def scores(self, signals: Mapping[str, Sequence[float | None]], cjk: bool) -> list[float]:
        """The head's order keys; ``signals`` maps each feature with a non-zero weight to one
        value per candidate (None: that leg missed it)."""
        w = self.weights["cjk" if cjk else "latin"]
        n = len(signals["rerank"])
        out = [0.0] * n
        for name, weight in w.items():
            if weight:
                for i, v in enumerate(normalised(signals[name])):
                    out[i] += weight * v
        return out

    def order(self, signals: Mapping[str, Sequence[float | None]], cjk: bool) -> list[int]:
        """Head indices, best first; ties keep the first-stage order."""
        keys = self.scores(signals, cjk)
        return sorted(range(len(keys)), key=lambda i: -keys[i])


def head_signals(head: Sequence[Candidate]) -> dict[str, list[float | None]]:
    """The features of reranked candidates (``rerank_score`` set), as the item dumps of
    ``service eval`` record them (the offline fit reads those)."""
    return {"rerank": [c.rerank_score for c in head], "fused": [c.fused_score for c in head],
            "bm25": [c.bm25_score for c in head], "dense": [c.dense_score for c in head],
            "latin_dense": [c.latin_dense_score for c in head]}


def read_order(model_dir: Path) -> HeadOrder | None:
    """The reranker's shipped order, or None when it ships none."""
    path = model_dir / ORDER_FILE
    return HeadOrder.load(path) if path.is_file() else None


def order_sha256(model_dir: Path) -> str | None:
    path = model_dir / ORDER_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
