"""The reranker's valid gate file (``valid_gate.json`` in its model dir).

``python -m service eval --split valid --lang L --reranker DIR --gate`` records, per
language, the tuned hybrid's nDCG@10 and the hybrid + rerank nDCG@10 for every
interpolation alpha (``alpha_sweep``), and whether the run covered the full split. The
file's ``alpha`` is the one with the best mean over the recorded languages, and each
language's ``hybrid_rerank`` is its value at that alpha, or, when the reranker ships a
``rerank_order.json`` (pipeline/head_order.py) and the server ordered the head by it, the
run's own hybrid + rerank nDCG@10 (``served_order``; ``head_order_sha256`` names the file). ``reranker_model = "auto"``
(service/app.py) reranks only when every gate language beats its hybrid there.
"""

from __future__ import annotations

import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from service.app import GATE_FILE, GATE_LANGUAGES, gate_failure
from service.models.manifest import read_manifest
from service.models.towers import SCORING_JOINT


def update_gate(model_dir: Path, lang: str, hybrid: float, sweep: dict[str, dict[str, float]], *, full_split: bool,
                full_corpus: bool = False,
                queries: int, documents: int, embedder: str, command: str = "",
                head_order: tuple[str, float] | None = None, scoring: str = SCORING_JOINT,
                rerank_top_n: int | None = None, passage_tokens: int | None = None) -> dict[str, Any]:
    """``head_order``: (sha256 of the rerank_order.json the server ordered the head by, the
    run's hybrid + rerank nDCG@10) when it served one; then that is the language's
    ``hybrid_rerank``, and every language must have been measured with the same file.
    ``scoring``: how the server scored pairs (joint or towers); every language must have been
    measured the same way. ``rerank_top_n``: how deep the server reranked (None: not
    recorded, as in gates before 2026-12-07, which measured 20); every language the same.
    ``passage_tokens``: the passage cap the server's reranker read (None: not recorded, as in
    gates before the trained cap became the default, which measured 128)."""
    sha = str(read_manifest(model_dir, "cross-encoder")["onnx_sha256"])
    path = model_dir / GATE_FILE
    try:
        gate: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        gate = {}
    order_sha = head_order[0] if head_order else None
    how = {"rerank_top_n": rerank_top_n, "passage_tokens": passage_tokens}  # how the head was reranked
    if (gate.get("onnx_sha256") != sha or gate.get("head_order_sha256") != order_sha
            or gate.get("scoring", SCORING_JOINT) != scoring or any(gate.get(k) != v for k, v in how.items())):
        gate = {}  # measured on another build, with another order, scoring, depth or cap: start over
    langs: dict[str, Any] = gate.get("languages", {})
    langs[lang] = {"hybrid": round(hybrid, 4), "alpha_sweep": {a: v["ndcg@10"] for a, v in sweep.items()},
                   "full_split": full_split, "full_corpus": full_corpus or full_split, "queries": queries, "documents": documents, "embedder": embedder,
                   "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command}
    if head_order:
        langs[lang]["served_order"] = round(head_order[1], 4)
    alphas = sorted(set.intersection(*(set(row["alpha_sweep"]) for row in langs.values())))
    best = max(alphas, key=lambda a: (statistics.fmean(row["alpha_sweep"][a] for row in langs.values()), -float(a)))
    for row in langs.values():
        row["hybrid_rerank"] = row["served_order"] if order_sha else row["alpha_sweep"][best]
        row["gain"] = round(row["hybrid_rerank"] - row["hybrid"], 4)
    gate = {"onnx_sha256": sha, "head_order_sha256": order_sha, "scoring": scoring,
            **{k: v for k, v in how.items() if v is not None}, "split": "valid",
            "metric": "ndcg@10", "alpha": float(best), "languages": langs, "required_languages": list(GATE_LANGUAGES)}
    why = gate_failure(gate, sha, order_sha, scoring)
    gate["passed"] = not why
    gate["reason"] = why
    path.write_text(json.dumps(gate, indent=2) + "\n", encoding="utf-8")
    return gate
