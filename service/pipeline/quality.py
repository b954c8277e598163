"""Calibrated quality: the probability that a candidate answers the query.

The agent contract derives ``relevance_level`` and the INSUFFICIENT gate from the top-1
quality, so quality must be a probability, not a similarity: e5 puts unrelated texts at
cosine ~0.8, and ``1 - L2/2`` over that says "REFERENCE" for any question at all.

Two calibrations, each a logistic regression over signals every candidate carries, fitted
on InsuranceQA **train** judgements through the real service (``service eval
--calibration-sample``, then ``python -m service.eval.calibration fit``) and shipped beside
the model it belongs to (``quality_calibration.json`` in the model dir, checked against the
model's ONNX hash, so a calibration never applies to a model it was not fitted on):

- ``hybrid`` (no rerank, or the reranker fell back): dense cosine, log BM25 score, which
  legs found the item, the fused score relative to the best possible fused score;
- ``rerank``: the cross-encoder logit plus the same hybrid signals.

The label is "this item is a judged answer", fitted on the top of each train list (the
rows an agent reads), so for the top item the probability answers the agent's question:
is the top of this list an answer? InsuranceQA judges one accepted answer among many
plausible ones, so the fitted probabilities are conservative (an unjudged but correct
answer counts as a miss); see README "Relevance and calibration". Without a calibration
(a dummy or unknown model) quality falls back to the uncalibrated sources of
``relevance.assign_quality`` and says so in ``quality_source``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from service.domain import SEARCH_LEGS, LegKind, QualitySource
from service.pipeline.fusion import Candidate, FusionParams, max_rrf_score
from service.pipeline.relevance import assign_quality, sigmoid

log = logging.getLogger(__name__)

CALIBRATION_FILE = "quality_calibration.json"
FALLBACK_REFERENCE = 0.5  # REFERENCE where no gate was fitted (the design's threshold)
CALIBRATION_VERSION = 1
HYBRID_FEATURES = ("dense_cos", "has_dense", "bm25_log", "has_bm25", "fused_rel")
RERANK_FEATURES = ("rerank_logit", *HYBRID_FEATURES)
# The Latin-script leg's cosine: read by the models of lists that leg answered in ("all").
LATIN_FEATURES = ("latin_cos", "has_latin")
KNOWN_FEATURES = (*RERANK_FEATURES, *LATIN_FEATURES)
# Each signal that an item can lack, and the feature that says whether it has it.
PRESENCE_FLAGS = {"dense_cos": "has_dense", "bm25_log": "has_bm25", "latin_cos": "has_latin"}


def features_for(kind: str, legs: str) -> tuple[str, ...]:
    """The features a calibration of ``kind`` fits for the leg set ``legs``."""
    base = RERANK_FEATURES if kind == "rerank" else HYBRID_FEATURES
    return (*base, *LATIN_FEATURES) if legs == "all" else base


LANGUAGES = ("en", "cjk")  # cjk: queries with Han characters (same split as fusion_for)
# Which legs the list came from: both (BM25 and kNN), or one kind (requested alone,
# or the other failed). A single-leg list has other signals (no agreement, fused score =
# that leg's rank, no cosine), so each calibration has one model per leg set. A list from the
# Latin-script leg alone (or with one other leg) has none: its quality stays uncalibrated.
# "all": BM25, kNN and the Latin-script leg (queries without Han characters where that leg
# is served): judged by an "all" model where a calibration has one (`calibration fit
# --leg-sets all`), else through the two-leg view (``TwoLegView``), as the shipped ones are.
LEG_SETS = ("both", "bm25", "knn", "all")
_NAMED_LEG_SETS = {frozenset((LegKind.BM25, LegKind.KNN)): "both", frozenset(SEARCH_LEGS): "all",
                   frozenset((LegKind.BM25,)): "bm25", frozenset((LegKind.KNN,)): "knn"}


def leg_set(kinds: Iterable[LegKind]) -> str:
    """The leg set of a list the ``kinds`` answered: a ``LEG_SETS`` name, else the kinds
    joined ("bm25+knn_latin": a set no calibration is fitted for; "knn" for none)."""
    found = frozenset(kinds)
    return _NAMED_LEG_SETS.get(found) or "+".join(sorted(k.value.lower() for k in found)) or "knn"


def signals(*, dense_score: float | None, bm25_score: float | None, fused_score: float, max_fused: float,
            rerank_score: float | None = None, latin_score: float | None = None) -> dict[str, float]:
    """The named features of one candidate. Everything here is also on the wire
    (``EvidenceItem``), so ``service eval`` fits on exactly what serving computes."""
    return {
        "dense_cos": float(dense_score) if dense_score is not None else 0.0,
        "has_dense": 1.0 if dense_score is not None else 0.0,
        "bm25_log": math.log1p(max(0.0, float(bm25_score))) if bm25_score is not None else 0.0,
        "has_bm25": 1.0 if bm25_score is not None else 0.0,
        "fused_rel": fused_score / max_fused if max_fused > 0 else 0.0,
        "rerank_logit": float(rerank_score) if rerank_score is not None else 0.0,
        "latin_cos": float(latin_score) if latin_score is not None else 0.0,
        "has_latin": 1.0 if latin_score is not None else 0.0,
    }


@dataclass(frozen=True)
class Logistic:
    """p = sigmoid(intercept + sum(coef * (x - mean) / scale)) over named features."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float
    # Per presence flag every fitting row had set (its mean is 1), the signal and the flag:
    # derived from the fit once, not per item (``probability`` runs for every candidate).
    _always_present: tuple[tuple[str, frozenset[str]], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fitted = dict(zip(self.features, self.mean))
        object.__setattr__(self, "_always_present", tuple(
            (flag, frozenset((value, flag))) for value, flag in PRESENCE_FLAGS.items() if fitted.get(flag, 0.0) >= 1.0))

    def probability(self, x: Mapping[str, float]) -> float:
        # A signal the fitting lists always had (e.g. every top item of a two-leg list had a
        # kNN cosine) but this item lacks (found by BM25 or the Latin-script leg alone) says
        # nothing the model learned: it counts as neutral (its fitted mean), and so does its
        # flag. Read as 0 it sits ~19 standard deviations from anything fitted, and the
        # model's sign for it, not the evidence, decides the item's quality.
        neutral = frozenset().union(*(names for flag, names in self._always_present if x.get(flag, 1.0) == 0.0))
        z = self.intercept
        for name, m, s, w in zip(self.features, self.mean, self.scale, self.coef):
            if name not in neutral:
                z += w * (x[name] - m) / s
        return sigmoid(z)

    def to_json(self) -> dict[str, Any]:
        return {"features": list(self.features), "mean": list(self.mean), "scale": list(self.scale),
                "coef": list(self.coef), "intercept": self.intercept}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Logistic:
        features = tuple(str(f) for f in d["features"])
        vectors = [tuple(float(v) for v in d[k]) for k in ("mean", "scale", "coef")]
        if any(len(v) != len(features) for v in vectors) or any(s <= 0 for s in vectors[1]):
            raise ValueError("calibration vectors must match the features, scales > 0")
        unknown = set(features) - set(KNOWN_FEATURES)
        if unknown:
            raise ValueError(f"unknown calibration features {sorted(unknown)}")
        return cls(features, vectors[0], vectors[1], vectors[2], float(d["intercept"]))


@dataclass(frozen=True)
class JointGate:
    """The "nothing here" gate of a reranked list, fitted on both judges at once: the list
    passes when its top's reranker probability reaches ``rerank`` and the first stage's
    quality of its fused top reaches ``first_stage`` (on the scale of the hybrid calibration
    whose fingerprint is ``first_stage_calibration``). Each source's own gate was fitted as
    if it judged alone, and the AND of two gates each at its own balance point refused
    answerable questions the pair did not need to (README "Relevance and quality", "The
    joint gate")."""

    rerank: float
    first_stage: float
    first_stage_calibration: str


def fingerprint(models: Mapping[str, Any]) -> str:
    """sha256 of a calibration's models, canonical JSON: what changes when a refit changes
    the probabilities (the scale a joint gate's first-stage threshold is on); a re-chosen
    gate does not."""
    canon = json.dumps(models, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Calibration:
    """One source's models per leg set and language ("both/en", "bm25/cjk", ...), valid only
    for the model with ``onnx_sha256``."""

    kind: str  # "hybrid" | "rerank"
    onnx_sha256: str
    models: dict[str, Logistic]
    # The default "nothing here" gate per model key (as ``models``): the min_quality chosen
    # when the calibration was fitted (valid answerable questions kept vs off-domain
    # questions refused); 0 where none was fitted.
    gates: dict[str, float] = field(default_factory=dict)
    # A rerank calibration's gate for a reranked list judged by both judges (JointGate), per
    # model key; empty where none was fitted (the AND of the two sources' own gates then).
    joint_gates: dict[str, JointGate] = field(default_factory=dict)
    # sha256 of the models (``fingerprint``): what a joint gate names as the first-stage
    # calibration its threshold is on the scale of.
    fingerprint: str = ""

    def gate(self, cjk: bool, legs: str = "both") -> float:
        """The gate of the model that judged the list: none where none was fitted (a leg
        set without one is not judged by another's)."""
        return self.gates.get(f"{legs}/{'cjk' if cjk else 'en'}", 0.0)

    def covers(self, cjk: bool, legs: str) -> bool:
        """Whether a model judges this leg set (the single-leg sets fall back to "both")."""
        lang = "cjk" if cjk else "en"
        return legs in LEG_SETS and (legs != "all" or f"all/{lang}" in self.models)

    def probability(self, x: Mapping[str, float], cjk: bool, legs: str = "both") -> float:
        lang = "cjk" if cjk else "en"
        model = self.models.get(f"{legs}/{lang}") or self.models[f"both/{lang}"]
        return model.probability(x)


def parse_calibration(data: Mapping[str, Any], kind: str) -> Calibration:
    if int(data.get("version", 0)) != CALIBRATION_VERSION:
        raise ValueError(f"calibration version {data.get('version')} (expected {CALIBRATION_VERSION})")
    if data.get("kind") != kind:
        raise ValueError(f"calibration kind {data.get('kind')!r} (expected {kind!r})")
    models = {str(k): Logistic.from_json(v) for k, v in data["models"].items()}
    for key in models:
        legs, _, lang = key.partition("/")
        if legs not in LEG_SETS or lang not in LANGUAGES:
            raise ValueError(f"unknown calibration model {key!r}")
    missing = [f"both/{lang}" for lang in LANGUAGES if f"both/{lang}" not in models]
    if missing:
        raise ValueError(f"calibration lacks {missing}")
    gates = {str(k): float(v) for k, v in data.get("gate", {}).items()}
    bad = [k for k, v in gates.items() if k not in models or not 0.0 <= v < 1.0]
    if bad:
        raise ValueError(f"gate {bad}: keys of the models, values in [0, 1)")
    joint = {str(k): JointGate(float(v["rerank"]), float(v["first_stage"]), str(v["first_stage_calibration"]))
             for k, v in data.get("joint_gate", {}).items()}
    bad = [k for k, j in joint.items()
           if kind != "rerank" or k not in models or not (0.0 <= j.rerank < 1.0 and 0.0 <= j.first_stage < 1.0)]
    if bad:
        raise ValueError(f"joint_gate {bad}: rerank calibrations only, keys of the models, values in [0, 1)")
    return Calibration(kind, str(data["onnx_sha256"]), models, gates, joint,
                       fingerprint(data["models"]))


def load_calibration(model_dir: Path | None, kind: str, onnx_sha256: str) -> Calibration | None:
    """The model dir's calibration of ``kind`` if present and fitted on this exact model;
    None (with the reason logged) otherwise."""
    if model_dir is None:
        return None
    path = model_dir / CALIBRATION_FILE
    if not path.is_file():
        log.warning("no %s in %s: %s quality stays uncalibrated", CALIBRATION_FILE, model_dir, kind)
        return None
    try:
        cal = parse_calibration(json.loads(path.read_text(encoding="utf-8")), kind)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: invalid quality calibration: {exc}") from exc
    if cal.onnx_sha256 != onnx_sha256:
        log.warning("%s was fitted on another build of %s: %s quality stays uncalibrated", path, model_dir.name, kind)
        return None
    return cal


@dataclass(frozen=True)
class TwoLegView:
    """How a list the Latin-script leg answered in ("all") is judged: each item as the two-leg
    calibration ("both") sees it, from what BM25 and kNN say of it (its ranks in their lists,
    fused with the two-leg settings), whatever the Latin-script leg added to its rank."""

    fusion: FusionParams  # the two-leg fusion (rrf_k, bm25_weight, knn_weight)

    def fused(self, c: Candidate) -> float:
        f = self.fusion
        return sum(w / (f.rrf_k + r) for w, r in ((f.bm25_weight, c.bm25_rank), (f.knn_weight, c.knn_rank))
                   if r is not None)

    @property
    def best(self) -> float:
        return max_rrf_score([self.fusion.bm25_weight, self.fusion.knn_weight], self.fusion.rrf_k)


@dataclass(frozen=True)
class QualityModel:
    """Assigns ``Candidate.quality`` and says which source it came from."""

    hybrid: Calibration | None = None
    rerank: Calibration | None = None
    two_leg: TwoLegView | None = None  # set where the Latin-script leg is served

    def _view(self, cal: Calibration | None, cjk: bool, legs: str) -> str:
        """The leg set whose model judges a list of ``legs``: a list the Latin-script leg
        answered in ("all") by an "all" model where ``cal`` has one, else through the two-leg
        view by the two-leg model ("both")."""
        if legs == "all" and self.two_leg is not None and not (cal is not None and cal.covers(cjk, "all")):
            return "both"
        return legs

    def _signals(self, c: Candidate, view: str, legs: str, scale: float) -> dict[str, float]:
        if view != legs:  # the two-leg view: what BM25 and kNN say of c, on their own scale
            assert self.two_leg is not None
            fused, scale = self.two_leg.fused(c), self.two_leg.best
        else:
            fused = c.fused_score
        return signals(dense_score=c.dense_score, bm25_score=c.bm25_score, fused_score=fused, max_fused=scale,
                       rerank_score=c.rerank_score, latin_score=c.latin_dense_score)

    def assign(self, c: Candidate, *, reranked: bool, max_fused: float, cjk: bool, legs: str = "both",
               answered_max_fused: float | None = None) -> QualitySource:
        """``legs``: which legs answered ("both", "bm25" or "knn"); ``answered_max_fused``:
        the best fused score those legs could give (the calibrations' scale); ``max_fused``:
        the best over every planned leg (the uncalibrated fallback's scale, so a degraded
        single-leg answer never looks perfect by rank alone)."""
        scale = max_fused if answered_max_fused is None else answered_max_fused
        if reranked and c.rerank_score is not None:
            view = self._view(self.rerank, cjk, legs)
            if self.rerank is not None and self.rerank.covers(cjk, view):
                c.quality = self.rerank.probability(self._signals(c, view, legs, scale), cjk, view)
            else:
                c.quality = sigmoid(c.rerank_score)
            return QualitySource.RERANKER_PROBABILITY
        view = self._view(self.hybrid, cjk, legs)
        if self.hybrid is not None and self.hybrid.covers(cjk, view):
            c.quality = self.hybrid.probability(self._signals(c, view, legs, scale), cjk, view)
            return QualitySource.HYBRID_CALIBRATED
        # No calibration, or none for this leg set (the Latin-script leg alone, say).
        return assign_quality(c, reranked=reranked, max_fused=max_fused)

    def joint_gate(self, cjk: bool, legs: str = "both") -> JointGate | None:
        """The joint gate of a reranked list of ``legs`` where the rerank calibration has one
        fitted against the served hybrid calibration; None otherwise (another hybrid
        calibration puts the first stage's quality on another scale)."""
        if self.rerank is None:
            return None
        joint = self.rerank.joint_gates.get(f"{self._view(self.rerank, cjk, legs)}/{'cjk' if cjk else 'en'}")
        return joint if joint is not None and self._fits_first_stage(joint) else None

    def _fits_first_stage(self, joint: JointGate) -> bool:
        return self.hybrid is not None and joint.first_stage_calibration == self.hybrid.fingerprint

    def stale_joint_gates(self) -> bool:
        """Whether the rerank calibration has joint gates fitted against another first-stage
        calibration than the served one (or none is served): they do not apply."""
        return self.rerank is not None and not all(map(self._fits_first_stage, self.rerank.joint_gates.values()))

    def default_gate(self, source: QualitySource, cjk: bool, legs: str = "both", judged_jointly: bool = False
                     ) -> float:
        """The min_quality an item of this source must reach when neither the request nor the
        server config sets one: its calibration's gate (0 for uncalibrated sources); for a
        reranked list that the first stage's judge also read (``judged_jointly``), the joint
        gate's reranker threshold where one applies."""
        if source is QualitySource.RERANKER_PROBABILITY and self.rerank is not None:
            joint = self.joint_gate(cjk, legs) if judged_jointly else None
            if joint is not None:
                return joint.rerank
            return self.rerank.gate(cjk, self._view(self.rerank, cjk, legs))
        if source is QualitySource.HYBRID_CALIBRATED and self.hybrid is not None:
            return self.hybrid.gate(cjk, self._view(self.hybrid, cjk, legs))
        return 0.0

    def first_stage_quality(self, ranked: Sequence[Candidate], *, max_fused: float, cjk: bool, legs: str = "both",
                            answered_max_fused: float | None = None) -> float | None:
        """The hybrid calibration's probability for the fused top of ``ranked`` (what the
        legs alone say of the best they found, before rerank), without touching any
        ``quality``; None without a hybrid calibration or candidates."""
        scale = max_fused if answered_max_fused is None else answered_max_fused
        view = self._view(self.hybrid, cjk, legs)
        if self.hybrid is None or not ranked or not self.hybrid.covers(cjk, view):
            return None
        c = ranked[self._first_stage_top(ranked, view, legs)]
        return self.hybrid.probability(self._signals(c, view, legs, scale), cjk, view)

    def _first_stage_top(self, ranked: Sequence[Candidate], view: str, legs: str) -> int:
        """Where in ``ranked`` the first stage's best item is: the fused top, or through the
        two-leg view the item BM25 and kNN rank best (the first of equals)."""
        if view == legs or self.two_leg is None or not ranked:
            return max(range(len(ranked)), key=lambda i: ranked[i].fused_score) if ranked else 0
        two_leg = self.two_leg
        return max(range(len(ranked)), key=lambda i: two_leg.fused(ranked[i]))

    def judged_index(self, ranked: Sequence[Candidate], sources: Sequence[QualitySource], cjk: bool,
                     legs: str = "both") -> int:
        """Which item of ``ranked`` the "nothing here" gate and the relevance level read: the
        top, except for a three-leg list judged through the two-leg view without rerank,
        where it is the item BM25 and kNN rank best. The two-leg gate was fitted on the
        two-leg top; the three-leg top may be an item the two legs rank lower, so judging it
        would refuse questions two legs answer. Judged this way, a list without rerank has
        an answer exactly when the two legs' best item says so, whatever the Latin-script
        leg added (README "The Latin-script dense leg")."""
        if not ranked or sources[0] is not QualitySource.HYBRID_CALIBRATED:
            return 0
        view = self._view(self.hybrid, cjk, legs)
        return 0 if view == legs else self._first_stage_top(ranked, view, legs)

    def gate(self, ranked: Sequence[Candidate], sources: Sequence[QualitySource], min_quality: float, *,
             cjk: bool, legs: str = "both", first_stage: float | None = None) -> list[Candidate]:
        """What passes the quality gate. A ``min_quality`` (the request's or the server's)
        filters items. Without one, the calibrations' "nothing here" gate judges the list by
        its top item (``judged_index``; the gate was fitted on top-1 items: it decides whether the corpus has
        an answer, not which of the items below the top an agent may read): all of it when
        the top reaches its calibration's gate, else nothing.

        ``first_stage``: for a reranked list, the hybrid calibration's quality of the fused
        top (before rerank). Both judges must find something: the reranker re-orders the
        first stage's candidates and cannot make a relevant one appear, and a cross-encoder
        trained on in-domain pairs only rates some off-domain questions (money, accounts) as
        plausibly answered by any text of the corpus, while the first stage's cosine and
        BM25 evidence says the corpus has nothing on them (README "Relevance and quality")."""
        if min_quality > 0:
            return [c for c in ranked if c.quality >= min_quality]
        j = self.judged_index(ranked, sources, cjk, legs)
        if ranked and self.passes_default_gate(ranked[j].quality, sources[j], cjk, legs, first_stage):
            return list(ranked)
        return []

    def passes_default_gate(self, top_quality: float, top_source: QualitySource, cjk: bool, legs: str = "both",
                            first_stage: float | None = None) -> bool:
        """The "nothing here" rule for a list whose top item has ``top_quality`` (see
        ``gate``); ``service.eval.calibration`` measures the same rule offline. A reranked list
        read by both judges meets the joint gate where one applies, else each judge's own."""
        if first_stage is not None and top_source is QualitySource.RERANKER_PROBABILITY:
            joint = self.joint_gate(cjk, legs)
            if joint is not None:
                return top_quality >= joint.rerank and first_stage >= joint.first_stage
        if top_quality < self.default_gate(top_source, cjk, legs):
            return False
        return not (first_stage is not None and top_source is QualitySource.RERANKER_PROBABILITY
                    and first_stage < self.default_gate(QualitySource.HYBRID_CALIBRATED, cjk, legs))

    def reference_threshold(self, source: QualitySource, cjk: bool, legs: str, configured: float,
                            judged_jointly: bool = False) -> float:
        """REFERENCE from ``configured`` when set, else from the source's gate (what passes
        the default gate has a level), else 0.5 (no gate fitted for this source or leg set).
        ``judged_jointly``: the list is reranked and the first stage's judge read it too."""
        if configured > 0:
            return configured
        joint = self.joint_gate(cjk, legs) if judged_jointly and source is QualitySource.RERANKER_PROBABILITY else None
        if joint is not None:  # a fitted 0 (the first stage's judge alone decides) is a gate, not "none fitted"
            return joint.rerank
        return self.default_gate(source, cjk, legs) or FALLBACK_REFERENCE

    def assign_all(self, ranked: Sequence[Candidate], *, reranked: bool, max_fused: float, cjk: bool,
                   legs: str = "both", answered_max_fused: float | None = None) -> list[QualitySource]:
        return [self.assign(c, reranked=reranked, max_fused=max_fused, cjk=cjk, legs=legs,
                            answered_max_fused=answered_max_fused) for c in ranked]

    def judge(self, ranked: list[Candidate], more: Callable[[int], list[Candidate]], *, reranked: bool,
              max_fused: float, cjk: bool, legs: str, answered_max_fused: float, min_quality: float,
              top_k: int) -> Judgement:
        """Quality for ``ranked`` (a prefix of the deduped list, in final order), the first
        stage's quality (reranked lists), what passes the gate and which item speaks for the
        list. A ``min_quality`` gate filters items, so while fewer than ``top_k`` pass,
        ``more(n)`` reads on (it appends to ``ranked`` and returns the new items; [] at the end)."""
        def assign(items: Sequence[Candidate]) -> list[QualitySource]:
            return self.assign_all(items, reranked=reranked, max_fused=max_fused, cjk=cjk, legs=legs,
                                   answered_max_fused=answered_max_fused)

        sources = assign(ranked)
        first_stage = self.first_stage_quality(ranked, max_fused=max_fused, cjk=cjk, legs=legs,
                                               answered_max_fused=answered_max_fused) if reranked else None
        gated = self.gate(ranked, sources, min_quality, cjk=cjk, legs=legs, first_stage=first_stage)
        while min_quality > 0 and len(gated) < top_k:
            extra = more(top_k - len(gated))
            if not extra:
                break
            extra_sources = assign(extra)
            sources.extend(extra_sources)
            gated.extend(self.gate(extra, extra_sources, min_quality, cjk=cjk, legs=legs))  # the same item filter
        judged = (ranked.index(gated[0]) if min_quality > 0 and gated
                  else self.judged_index(ranked, sources, cjk, legs))
        return Judgement(sources, gated, first_stage, judged)


class Judgement(NamedTuple):
    """What ``QualityModel.judge`` decided of a list."""

    sources: list[QualitySource]  # one per item of the list read
    gated: list[Candidate]  # what passes the gate, in list order
    first_stage: float | None  # the first stage's quality of a reranked list, else None
    # The index of the item whose quality is the list's (``top_quality``, the relevance
    # level): the first that passes a min_quality, else ``QualityModel.judged_index``.
    judged: int
