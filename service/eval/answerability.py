"""Can the service say "nothing here"? Off-topic and gibberish questions against answerable ones.

The agent contract's first promise: a question the knowledge base cannot answer ends
INSUFFICIENT with no relevance level, while a question it answers keeps EVIDENCE_FOUND.
``probe`` sends each question twice through the real ``Retrieve`` API: once with the
server's defaults (the outcome an agent gets) and once without a quality gate (the top-1
item and its quality, so the operating curve over ``min_quality`` can be drawn).

Answerable = an in-domain question whose ungated top-1 is one of its judged answers. Off
topic = questions from another domain than the corpus (general knowledge, and the other
test corpus's questions: demo <-> InsuranceQA), and seeded gibberish, in English and Chinese.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.eval.datasets import Judged

# General-knowledge questions no product or insurance knowledge base answers.
GENERAL_OFF_TOPIC: dict[str, tuple[str, ...]] = {
    "en": (
        "what is the capital of mongolia",
        "who painted the mona lisa",
        "how many moons does jupiter have",
        "how do I bake sourdough bread at home",
        "who won the football world cup in 1998",
        "how tall is mount everest",
        "what language do people speak in brazil",
        "how do volcanoes form",
        "what is the chemical symbol for gold",
        "when did the roman empire fall",
        "how do I tune a guitar",
        "what do giraffes eat in the wild",
    ),
    "zh": (
        "蒙古的首都是哪里",
        "蒙娜丽莎是谁画的",
        "木星有多少颗卫星",
        "在家怎么烤酸面包",
        "1998年世界杯冠军是哪个国家",
        "珠穆朗玛峰有多高",
        "巴西人说什么语言",
        "火山是怎么形成的",
        "金的化学符号是什么",
        "罗马帝国是什么时候灭亡的",
        "怎么给吉他调音",
        "长颈鹿在野外吃什么",
    ),
}

_HAN = [chr(c) for c in range(0x4E00, 0x9FA6)]


def gibberish(n: int, lang: str, seed: int = 0) -> list[str]:
    """Seeded nonsense: random lowercase 'words' (en) or random Han characters (zh)."""
    rng = random.Random(f"gibberish-{lang}-{seed}")
    out = []
    for _ in range(n):
        if lang == "zh":
            out.append("".join(rng.choice(_HAN) for _ in range(rng.randint(6, 12))))
        else:
            out.append(" ".join("".join(rng.choice("bcdfghjklmnpqrstvwxzaeiouy") for _ in range(rng.randint(4, 7)))
                                for _ in range(rng.randint(3, 5))))
    return out


# Software-product support questions for a knowledge base of another domain (InsuranceQA):
# held out, never fitted (the training file has its own, disjoint ones).
PRODUCT_SUPPORT_OFF_TOPIC: dict[str, tuple[str, ...]] = {
    "en": (
        "how do I change my profile picture",
        "can I recover a workspace I archived",
        "why is the dashboard loading so slowly",
        "how do I print a monthly report",
        "where do I manage billing contacts",
        "how do I set a reminder for a task",
        "can I undo sending a message",
        "how do I turn on automatic backups",
    ),
    "zh": (
        "怎么修改头像",
        "归档的工作区还能恢复吗",
        "仪表盘加载很慢怎么办",
        "怎么打印月度报表",
        "在哪里管理账单联系人",
        "如何给任务设置提醒",
        "发出的消息可以撤回吗",
        "如何开启自动备份",
    ),
}

OFF_DOMAIN_TRAIN = Path(__file__).with_name("data") / "off_domain_train.json"
TEST_GIBBERISH_SEED = 0  # the answerability test's; training gibberish uses other seeds


def off_domain_training(gibberish_per_lang: int = 20, seeds: Sequence[int] = (1, 2)) -> Judged:
    """The calibration's 'nothing here' negatives: the shipped off-domain questions (en and
    zh) and seeded gibberish, as an unjudged set (no relevant answer for any question).
    Disjoint from what the answerability test asks."""
    data = json.loads(OFF_DOMAIN_TRAIN.read_text(encoding="utf-8"))
    questions = [*data["en"], *data["zh"]]
    for seed in seeds:
        assert seed != TEST_GIBBERISH_SEED
        for lang in ("en", "zh"):
            questions += gibberish(gibberish_per_lang, lang, seed)
    queries = {f"off-{i:04d}": q for i, q in enumerate(questions)}
    return Judged(name="off-domain-train", corpus={}, queries=queries, qrels={q: set() for q in queries})


@dataclass
class Probe:
    query: str
    kind: str  # "in_domain" | "off_topic" | "gibberish"
    relevant: frozenset[str] = frozenset()  # judged answers (source ids), in-domain only
    lang: str = "en"


@dataclass
class ProbeResult:
    probe: Probe
    outcome: str  # with the server's defaults
    relevance_level: str
    quality_source: str
    top_quality: float  # of the ungated top-1
    top1: str  # source id of the ungated top-1 ("" when nothing came back)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def answerable(self) -> bool:
        return self.probe.kind == "in_domain" and self.top1 in self.probe.relevant

    @property
    def said_nothing_here(self) -> bool:
        return self.outcome == "ATTEMPT_OUTCOME_INSUFFICIENT" and self.relevance_level == "RELEVANCE_LEVEL_UNSPECIFIED"


async def probe(stub: Any, probes: Sequence[Probe], *, rerank: bool, top_k: int = 5,
                timeout_s: float = 30.0) -> list[ProbeResult]:
    from service._gen.retrieval.v1 import retrieval_pb2, types_pb2

    mode = types_pb2.RERANK_MODE_ON if rerank else types_pb2.RERANK_MODE_OFF
    out = []
    for p in probes:
        gated = None
        async for ev in stub.Retrieve(retrieval_pb2.RetrieveRequest(
                query=p.query, top_k=top_k, options=retrieval_pb2.RetrievalOptions(rerank=mode)), timeout=timeout_s):
            if ev.WhichOneof("event") == "result":
                gated = ev.result
        top1, quality = "", 0.0
        async for ev in stub.Retrieve(retrieval_pb2.RetrieveRequest(
                query=p.query, top_k=1, options=retrieval_pb2.RetrievalOptions(rerank=mode, min_quality=1e-12)),
                timeout=timeout_s):
            if ev.WhichOneof("event") == "evidence" and not top1:
                top1, quality = ev.evidence.source_id, ev.evidence.quality
        assert gated is not None
        out.append(ProbeResult(p, types_pb2.AttemptOutcome.Name(gated.outcome),
                               types_pb2.RelevanceLevel.Name(gated.relevance_level),
                               types_pb2.QualitySource.Name(gated.quality_source), quality, top1))
    return out


def summarize(results: Sequence[ProbeResult]) -> dict[str, Any]:
    """Rates with the server's defaults: off-topic/gibberish that said "nothing here", and
    answerable questions that kept EVIDENCE_FOUND (with the levels they got)."""
    off = [r for r in results if r.probe.kind != "in_domain"]
    ans = [r for r in results if r.answerable]
    levels: dict[str, int] = {}
    for r in ans:
        levels[r.relevance_level] = levels.get(r.relevance_level, 0) + 1
    return {
        "off_topic": len(off),
        "off_topic_nothing_here": round(sum(r.said_nothing_here for r in off) / len(off), 4) if off else None,
        "off_topic_failures": [(r.probe.query, r.outcome, round(r.top_quality, 3)) for r in off if not r.said_nothing_here],
        "answerable": len(ans),
        "answerable_found": round(sum(r.outcome == "ATTEMPT_OUTCOME_EVIDENCE_FOUND" for r in ans) / len(ans), 4)
        if ans else None,
        "answerable_failures": [(r.probe.query, r.outcome, round(r.top_quality, 3))
                                for r in ans if r.outcome != "ATTEMPT_OUTCOME_EVIDENCE_FOUND"],
        "answerable_levels": levels,
        "found_without_level": sum(r.outcome == "ATTEMPT_OUTCOME_EVIDENCE_FOUND"
                                   and r.relevance_level == "RELEVANCE_LEVEL_UNSPECIFIED" for r in results),
        "quality_sources": sorted({r.quality_source for r in results if r.quality_source != "QUALITY_SOURCE_UNSPECIFIED"}),
    }


def operating_curve(results: Sequence[ProbeResult], thresholds: Sequence[float]) -> list[dict[str, float]]:
    """For each candidate ``min_quality``: the share of off-topic questions it refuses and
    the share of answerable ones it keeps (from the ungated top-1 quality)."""
    off = [r.top_quality for r in results if r.probe.kind != "in_domain"]
    ans = [r.top_quality for r in results if r.answerable]
    rows = []
    for t in thresholds:
        rows.append({"min_quality": t,
                     "off_topic_refused": round(sum(q < t for q in off) / len(off), 4) if off else 0.0,
                     "answerable_kept": round(sum(q >= t for q in ans) / len(ans), 4) if ans else 0.0})
    return rows
