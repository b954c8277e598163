"""Two-tower scoring of the split reranker (README "Two towers").

The split reranker's upper layers run on the query and the passage together, joined only by
cross-segment attention under a learned per-head bias. Where training left that bias shut
(the shipped reranker's sit at -4 to -9, and cutting them changed valid nDCG@10 by nothing
measurable), each side's upper layers can run alone: the *tower* graph maps one side's
states at the split point to its pooled, L2-normalised vector, and the score is the head
applied to the two vectors, ``sum(w * q * p) + b``. A passage's vector then depends on the
passage alone, so it is stored at ingest like the passage states were (a few hundred bytes
instead of kilobytes), and a rerank runs the query's layers once and a dot product per pair.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
TOWER_HEAD_FILE = "tower_head.npz"
# The manifest's ``scoring``: what a split reranker's artifact was measured serving.
SCORING_JOINT = "joint"
SCORING_TOWERS = "towers"
SCORING_CHOICES = ("auto", SCORING_JOINT, SCORING_TOWERS)  # rerank_scoring


def save_tower_head(path: Path, w: F32, b: float) -> None:
    """The head the two vectors meet in: ``w`` [hidden], ``b``, fp32."""
    with path.open("wb") as f:
        np.savez(f, w=np.asarray(w, np.float32), b=np.asarray(b, np.float32))


def load_tower_head(path: Path) -> tuple[F32, float]:
    with np.load(path) as z:
        w, b = np.asarray(z["w"], np.float32), float(np.asarray(z["b"]))
    if w.ndim != 1:
        raise ValueError(f"{path}: head weight must be [hidden], got {w.shape}")
    return w, b


def tower_logits(query_vectors: F32, passage_vectors: F32, w: F32, b: float) -> F32:
    """Row i: ``sum(w * query_vectors[i] * passage_vectors[i]) + b`` (the joint head's
    ``MatMul(q * p, w) + b`` on vectors pooled without cross attention)."""
    out: F32 = ((np.asarray(query_vectors, np.float32) * np.asarray(passage_vectors, np.float32)) @ w + b).astype(np.float32)
    return out


def served_scoring(manifest: dict[str, object], requested: str = "auto") -> str:
    """How a reranker with this manifest scores when ``requested`` (``rerank_scoring``):
    "auto" = what its artifact was measured serving (the manifest's ``scoring``; "joint"
    when it names none), "joint" or "towers" forced. A reranker without a tower graph (the
    one graph only, or a build from before the towers) scores jointly; forcing "towers" on
    it is an error."""
    if requested not in SCORING_CHOICES:
        raise ValueError(f"rerank_scoring must be one of {', '.join(SCORING_CHOICES)}, not {requested!r}")
    states = manifest.get("states")
    has_towers = manifest.get("architecture") == "split" and isinstance(states, dict) and "tower_file" in states
    choice = str(manifest.get("scoring", SCORING_JOINT)) if requested == "auto" else requested
    if choice == SCORING_TOWERS and not has_towers:
        if requested == SCORING_TOWERS:
            raise ValueError(f"rerank_scoring = towers, but {manifest.get('model_id')} has no tower graph "
                             "(`python -m service models build` writes one for split rerankers)")
        return SCORING_JOINT
    return choice
