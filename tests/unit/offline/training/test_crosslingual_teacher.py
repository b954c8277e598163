"""Cross-lingual distillation targets: a Chinese training pair is scored by the served reranker
reading its parallel English question and answer (same ids, so the same pack indices), through
the joint graph over the split cache's English states; the targets load as a teacher.

A tiny parallel "InsuranceQA" stands in for the real one (the whole-split, whole-corpus pack is
what makes the two languages' indices parallel); the reranker and the lower graph are the real
shipped ones. No torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

EN = {
    "q1": ("how much does term life insurance cost", "a1", "Term life insurance costs depend on your age, health and the amount of cover."),
    "q2": ("can i cancel my car insurance at any time", "a2", "You can cancel car insurance at any time; the insurer refunds the unused premium."),
    "q3": ("does home insurance cover flood damage", "a3", "Standard home insurance does not cover flood damage; buy separate flood cover."),
    "q4": ("what is a deductible in health insurance", "a4", "A health insurance deductible is what you pay before the insurer starts paying."),
    "q5": ("is pet insurance worth it for an old dog", "a5", "Pet insurance for an old dog is expensive and excludes pre-existing conditions."),
    "q6": ("how do annuities pay out in retirement", "a6", "An annuity pays a fixed income in retirement, monthly or yearly, for life."),
}
# The "translations" are deliberately about something else, so reading them scores differently.
ZH = ["今天天气很好，我们去公园散步吧。", "这家餐厅的面条非常好吃。", "火车站在城市的北边。",
      "我的猫喜欢在窗台上睡觉。", "周末我们一起去看电影。", "这本书讲的是一个古老的故事。"]


def _fake_insuranceqa(split: str, lang: str) -> object:
    from service.eval.datasets import Judged

    ids = sorted(EN)
    corpus = {a: (text if lang == "en" else ZH[i]) for i, (_, a, text) in enumerate(EN[q] for q in ids)}
    queries = {q: (EN[q][0] if lang == "en" else ZH[-1 - i]) for i, q in enumerate(ids)}
    qrels = {q: {EN[q][1]} for q in ids}
    return Judged(name=f"fake-{split}-{lang}", corpus=corpus, queries=queries, qrels=qrels, lang=lang)


def test_chinese_pairs_are_scored_reading_their_english_side(tmp_path: Path, models_dir: Path, e5_int8_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from service.eval import datasets
    from service.models.onnx_cross_encoder import OnnxCrossEncoder
    from service.offline.training.crosslingual_teacher import score
    from service.offline.training.pack import build_pack
    from service.offline.training.split import main as split_main
    from service.offline.training.teacher import load_teacher, question_pairs
    from service.offline.training.data import load_pack

    monkeypatch.setattr(datasets, "load_insuranceqa", _fake_insuranceqa)
    pack_dir, cache = tmp_path / "pack", tmp_path / "cache"
    build_pack(pack_dir, ("en", "zh"), valid_questions=2, bm25_negatives=3, shipped_negatives=0, candidates=4,
               dense=False, model_dir=e5_int8_dir, log=lambda m: None)
    split_main(["cache", "--pack", str(pack_dir), "--cache", str(cache), "--lower", "9", "--langs", "en"])
    reranker = models_dir / "e5-small-split-reranker-int8"
    out = tmp_path / "teacher.npz"
    score(pack_dir, cache, reranker, "en", "zh", 4, out, threads=1, log=lambda m: None)

    meta, table = load_teacher(out)
    assert meta["report"]["zh"]["scored"] == 4 and table["en"] == {}  # English learns from its labels
    pack = load_pack(pack_dir)
    off, doc = question_pairs(pack, "zh")
    assert set(table["zh"]) == {(qi, int(x)) for qi in range(4) for x in doc[off[qi] : off[qi + 1]]}
    # Pack indices follow the sorted ids in both languages: question qi is EN[ids[qi]], and
    # passage x the x-th answer id by (length, id).
    ids = sorted(EN)
    answers = sorted((a for _, a, _ in EN.values()), key=lambda a: (len(a), a))
    text = {a: t for _, a, t in EN.values()}
    ce = OnnxCrossEncoder(reranker)
    gaps: dict[str, list[float]] = {"en": [], "zh": []}
    for (qi, x), logit in table["zh"].items():
        english = (EN[ids[qi]][0], text[answers[x]])
        chinese = (ZH[-1 - qi], ZH[sorted(text).index(answers[x])])
        for lang, pair in (("en", english), ("zh", chinese)):
            gaps[lang].append(abs(float(ce.infer(ce.tokenize([pair]))[0]) - logit))
    # Against the one graph on the English texts: its int8 noise against the two graphs
    # (max |d| ~1.07 measured, README "Cached passage states"); the Chinese texts are far off.
    assert max(gaps["en"]) < 1.2 and min(gaps["zh"]) > 2.0, gaps
    assert json.loads(json.dumps(meta))["kind"] == "cross-lingual"


def test_a_pack_that_is_not_parallel_is_refused(tmp_path: Path) -> None:
    from service.offline.training.crosslingual_teacher import score

    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "manifest.json").write_text(json.dumps({"source": {"data": "user judgements a.jsonl"}, "langs": ["en", "zh"]}))
    np.savez(pack / "data.npz", vocab_keep=np.zeros(1, np.int64))
    with pytest.raises(SystemExit, match="parallel"):
        score(pack, tmp_path / "cache", tmp_path / "reranker", "en", "zh", 1, tmp_path / "t.npz")
