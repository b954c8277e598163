"""The split reranker's training path on a tiny pack built from a user's own JSONL
judgements: pack (held-out valid) -> lower-layer cache -> train -> resume -> export ->
the exported model served by the real runner, ranking like the trainer scored it.

The pack part needs no torch; the rest skips without the ``train`` extra, saying so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

TORCH_REASON = "torch is not installed (training-only extra: pip install '.[train]')"
TOPICS = ["life insurance", "car insurance", "home insurance", "health insurance", "travel insurance",
          "pet insurance", "disability insurance", "renters insurance"]


def _write_user_data(tmp: Path) -> tuple[Path, Path]:
    docs, judgements = [], []
    for i, topic in enumerate(TOPICS):
        docs.append({"source_id": f"d{i}", "text": f"{topic.capitalize()} pays out when the insured event happens. "
                                                   f"Premiums for {topic} depend on your risk profile and coverage."})
        docs.append({"source_id": f"x{i}", "text": f"Cancelling {topic} early may cost a fee; read the policy terms."})
        judgements.append({"id": f"q{i}", "query": f"how are {topic} premiums set?", "positives": [f"d{i}"],
                           "negatives": [f"x{i}"]})
    corpus, judged = tmp / "corpus.jsonl", tmp / "judgements.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    judged.write_text("".join(json.dumps(j) + "\n" for j in judgements))
    return judged, corpus


def _pack(tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from service.offline.training.pack import build_pack

    monkeypatch.setenv("RETRIEVAL_EMBEDDINGS_CACHE", str(tmp_path / "emb-cache"))
    pack_dir = tmp_path / "pack"
    build_pack(pack_dir, ("user",), valid_questions=2, bm25_negatives=4, dense_negatives=4, shipped_negatives=1,
               candidates=8, model_dir=e5_int8_dir, judgements=_write_user_data(tmp_path), log=lambda m: None)
    return pack_dir


def _pack_and_cache(tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The tiny pack and its lower-state cache at layer 10."""
    from service.offline.training.split import main as split_main

    pack_dir = _pack(tmp_path, e5_int8_dir, monkeypatch)
    cache = tmp_path / "cache"
    split_main(["cache", "--pack", str(pack_dir), "--cache", str(cache), "--lower", "10"])
    return pack_dir, cache


def _run_tiny(pack_dir: Path, cache: Path, out: Path, *extra: str) -> None:
    """One fp32 epoch on the tiny pack (groups of 3, 2 a step)."""
    from service.offline.training.split import main as split_main

    split_main(["train", "--pack", str(pack_dir), "--cache", str(cache), "--out", str(out), "--group", "3",
                "--batch-groups", "2", "--final-eval-questions", "2", "--eval-depth", "8", "--fp32",
                "--threads", "1", "--epochs", "1", *extra])


def _train_tiny(pack_dir: Path, cache: Path, out: Path, *extra: str) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """``_run_tiny``, then the run's metadata and tensors as export reads them."""
    from service.offline.training.split_export import load_run

    _run_tiny(pack_dir, cache, out, *extra)
    meta, _, _, tensors = load_run(out)
    return meta, tensors


def test_pack_from_user_judgements_holds_out_valid(tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.offline.training.data import load_pack

    pack = load_pack(_pack(tmp_path, e5_int8_dir, monkeypatch))
    d = pack.langs["user"]
    # 8 judged queries: valid_questions=2 asked, but at most a fifth is held out.
    assert len(d.train_q) == 7 and len(d.valid_q) == 1 and len(d.docs) == 16
    assert pack.manifest["stats"]["user"]["valid_questions"] == 1
    for qi in range(len(d.train_q)):  # a judged positive is never a negative
        assert len(d.train_pos[qi]) == 1 and not set(d.train_pos[qi].tolist()) & set(d.train_neg[qi].tolist())
    assert d.valid_rel.any(axis=1).all()  # every held-out question has its answer among the candidates


def test_the_pack_ranks_each_negative_in_the_fused_first_stage(tmp_path: Path, e5_int8_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from service.offline.training.data import load_pack
    from service.offline.training.pack import NOT_RANKED, SRC_BM25, SRC_DENSE

    d = load_pack(_pack(tmp_path, e5_int8_dir, monkeypatch)).langs["user"]
    assert d.train_neg_rank is not None
    ranked_any = False
    for qi in range(len(d.train_q)):
        rank, src = d.train_neg_rank[qi], d.train_neg_src[qi]
        assert len(rank) == len(d.train_neg[qi])
        ranked = rank[rank != NOT_RANKED]
        assert len(set(ranked.tolist())) == len(ranked) and (ranked < 8).all()  # positions in the top 8
        ranked_any |= bool(len(ranked))
        # a negative in both legs' top 4 is in the fused top 8 (RRF of two top-8 lists)
        assert (rank[(src & SRC_BM25 > 0) & (src & SRC_DENSE > 0)] != NOT_RANKED).all()
    assert ranked_any


def test_hard_negatives_come_from_the_first_stage_top() -> None:
    from service.offline.training.split import draw_negatives

    neg = np.arange(100, 160)
    rank = np.full(60, 255, dtype=np.uint8)
    hard_idx = np.random.default_rng(0).choice(60, size=20, replace=False)
    rank[hard_idx] = np.arange(20)
    hard = set(neg[hard_idx].tolist())
    rng = np.random.default_rng(1)
    draws = [draw_negatives(rng, neg, rank, 7, 20, 4 / 7) for _ in range(300)]
    assert all(len(x) == 7 and len(set(x)) == 7 and set(x) <= set(neg.tolist()) for x in draws)
    assert all(len(set(x) & hard) >= 4 for x in draws)  # 4 from the top, 3 from anywhere
    uniform = [draw_negatives(rng, neg, rank, 7, 20, 0.0) for _ in range(300)]
    share = np.mean([len(set(x) & hard) / 7 for x in uniform])
    assert 0.25 < share < 0.42  # a third of the negatives are in the top 20
    assert len(draw_negatives(rng, neg, None, 7, 20, 0.5)) == 7  # a pack without ranks: uniform
    few = np.full(60, 255, dtype=np.uint8)
    few[:2] = [0, 1]
    assert all({100, 101} <= set(draw_negatives(rng, neg, few, 7, 20, 4 / 7)) for _ in range(20))  # all 2 hard ones
    short = draw_negatives(rng, neg[:3], rank[:3], 7, 20, 0.5)  # fewer negatives than the group: repeats
    assert len(short) == 7 and set(short) <= {100, 101, 102}


def test_training_draws_hard_negatives_only_from_a_pack_that_ranks_them(tmp_path: Path, e5_int8_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.offline.training.split import main as split_main

    pack_dir, cache = _pack_and_cache(tmp_path, e5_int8_dir, monkeypatch)
    meta, _ = _train_tiny(pack_dir, cache, tmp_path / "run", "--hard-share", "0.5", "--hard-top", "4")
    args = meta["args"]
    assert isinstance(args, dict) and args["hard_share"] == "0.5" and args["hard_top"] == "4"
    # A pack from before ranks were stored is refused, not silently trained uniformly.
    with np.load(pack_dir / "data.npz") as z:
        arrays = {k: z[k] for k in z.files if not k.endswith("_train_neg_rank")}
    np.savez_compressed(pack_dir / "data.npz", **arrays)
    with pytest.raises(SystemExit, match="no train_neg_rank"):
        _train_tiny(pack_dir, cache, tmp_path / "old", "--hard-share", "0.5")


def test_a_user_corpus_is_packed_as_serving_reads_it(tmp_path: Path, e5_int8_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A reranker trained on your own corpus reads each passage with its title and breadcrumb,
    as the served reranker judges a chunk, and negatives are mined with the vectors ingest
    stores (heading breadcrumbs included)."""
    from tokenizers import Tokenizer

    from service.eval.embedding_cache import CachedEmbedder
    from service.models.onnx_embedder import load_embedder
    from service.offline.training.data import load_pack
    from service.offline.training.pack import build_pack

    judged, corpus = _write_user_data(tmp_path)
    docs = [json.loads(line) for line in corpus.read_text().splitlines()]
    docs[0].update(title="Life cover", breadcrumb="Help Center > Policies")
    docs[2].update(title="Car cover", text="# Claims\n" + docs[2]["text"])
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.setenv("RETRIEVAL_EMBEDDINGS_CACHE", str(tmp_path / "emb-cache"))
    pack_dir = tmp_path / "pack"
    build_pack(pack_dir, ("user",), valid_questions=2, bm25_negatives=4, dense_negatives=4, shipped_negatives=1,
               candidates=8, model_dir=e5_int8_dir, judgements=(judged, corpus), log=lambda m: None)
    pack = load_pack(pack_dir)
    tok = Tokenizer.from_file(str(e5_int8_dir / "tokenizer.json"))
    packed = pack.langs["user"].docs
    rows = {tuple(pack.vocab_keep[packed[i]].tolist()) for i in range(len(packed))}
    life = docs[0]["text"]
    assert tuple(tok.encode(f"Life cover\nHelp Center > Policies\n{life}", add_special_tokens=False).ids) in rows
    assert tuple(tok.encode(life, add_special_tokens=False).ids) not in rows
    cached = CachedEmbedder(load_embedder(e5_int8_dir, threads=1))
    assert cached.contains(f"Life cover\nHelp Center > Policies\n{life}")
    assert cached.contains(f"Car cover\nClaims\n{docs[2]['text'].split(chr(10), 1)[1]}")
    assert not cached.contains(life)  # the old layout: text alone


def test_split_cache_train_resume_export_serve(tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.models.onnx_cross_encoder import load_cross_encoder
    from service.offline.training.split import main as split_main
    from service.offline.training.split_export import export

    pack_dir = _pack(tmp_path, e5_int8_dir, monkeypatch)
    cache, out = tmp_path / "cache", tmp_path / "run"
    split_main(["cache", "--pack", str(pack_dir), "--cache", str(cache), "--lower", "10"])
    assert json.loads((cache / "cache.json").read_text())["layout"]["lower"] == 10
    common = ["train", "--pack", str(pack_dir), "--cache", str(cache), "--out", str(out), "--group", "3",
              "--batch-groups", "2", "--eval-questions", "2", "--final-eval-questions", "2", "--eval-depth", "8",
              "--log-every", "1", "--fp32", "--threads", "1"]
    split_main(common + ["--epochs", "1"])  # 7 train questions // 2 per step = 3 steps
    first = json.loads((out / "split-weights.json").read_text())
    assert first["steps"] == 3
    assert first["precision"] == "fp32"  # the precision that ran, not only the flags asked for
    split_main(common + ["--epochs", "2", "--resume"])
    second = json.loads((out / "split-weights.json").read_text())
    assert second["steps"] == 6  # continued from the checkpoint, not from scratch
    final = second["final_eval"]["user"]
    assert set(final["interp"]) >= {"0.0", "0.5", "1.0"} and 0.0 <= final["first_stage"] <= 1.0
    events = [json.loads(x)["event"] for x in (out / "log.jsonl").read_text().splitlines()]
    assert events.count("final_eval") == 2 and "progress" in events

    report = export(out, tmp_path / "models" / "tiny-split", pack_dir, e5_int8_dir, parity_questions=2,
                    calibration_questions=2, log=lambda m: None)
    assert report["variants"]["fp32"]["max_abs_diff_vs_torch"] < 1e-3
    assert report["calibration"]["pairs"] == 8  # 1 held-out question x 8 candidates
    for precision in ("fp32", "int8"):
        model_dir = tmp_path / "models" / f"tiny-split-{precision}"
        manifest = json.loads((model_dir / "manifest.json").read_text())
        assert manifest["architecture"] == "split" and manifest["lower_layers"] == 10
        runner = load_cross_encoder(model_dir, threads=1)
        pairs = [("how are pet insurance premiums set?", "Premiums for pet insurance depend on your risk profile."),
                 ("how are pet insurance premiums set?", "Cancelling car insurance early may cost a fee.")]
        scores = runner.infer(runner.tokenize(pairs))
        assert scores.shape == (2,) and np.isfinite(scores).all()


def test_training_continues_from_a_shipped_delta(tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --init-from starts the joint layers, biases and head from a reranker's delta.npz (more
    # steps for a shipped model) instead of the wheel's layers; a delta of another shape is refused.
    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.offline.builder.reranker import load_delta, save_delta

    pack_dir, cache = _pack_and_cache(tmp_path, e5_int8_dir, monkeypatch)

    def train(out: Path, *extra: str) -> dict[str, np.ndarray]:
        return _train_tiny(pack_dir, cache, out, *extra)[1]

    trained = train(tmp_path / "first", "--lr", "1e-3")
    delta = save_delta(trained, tmp_path / "delta.npz")
    # At lr 0 nothing moves: what the continued run saves is exactly the delta it started from.
    continued = train(tmp_path / "continued", "--lr", "0", "--init-from", str(tmp_path / "delta.npz"))
    assert set(continued) == set(delta)
    assert max(float(np.abs(continued[k] - delta[k]).max()) for k in delta) == 0.0
    fresh = train(tmp_path / "fresh", "--lr", "0")  # without it: the wheel's layers, bias -6
    assert float(np.abs(fresh["cross_bias"] + 6.0).max()) == 0.0
    assert float(np.abs(fresh["layers.0.q.weight"] - delta["layers.0.q.weight"]).max()) > 0.0
    partial = {k: v for k, v in load_delta(tmp_path / "delta.npz").items() if not k.startswith("layers.1.")}
    np.savez(tmp_path / "one-layer.npz", **partial)  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="not a delta of 2 joint layers"):
        train(tmp_path / "wrong", "--init-from", str(tmp_path / "one-layer.npz"))
    # --new-lower-layers 1: a third joint layer below the delta's two (split one layer lower),
    # from the wheel's layer with its cross-attention shut; the delta's layers move up by one.
    from service.offline.training.split import main as split_main

    cache9 = tmp_path / "cache9"
    split_main(["cache", "--pack", str(pack_dir), "--cache", str(cache9), "--lower", "9"])
    grown = _train_tiny(pack_dir, cache9, tmp_path / "grown", "--lr", "0", "--upper", "3", "--init-from",
                        str(tmp_path / "delta.npz"), "--new-lower-layers", "1", "--cross-bias-init", "-10")[1]
    wheel9 = _train_tiny(pack_dir, cache9, tmp_path / "wheel9", "--lr", "0", "--upper", "3")[1]
    assert grown["cross_bias"].shape == (3, delta["cross_bias"].shape[1])
    assert float(np.abs(grown["cross_bias"][0] + 10.0).max()) == 0.0
    assert np.array_equal(grown["cross_bias"][1:], delta["cross_bias"]) and np.array_equal(grown["head_w"], delta["head_w"])
    for key in delta:
        if key.startswith("layers."):
            i, rest = key.split(".", 2)[1:]
            assert np.array_equal(grown[f"layers.{int(i) + 1}.{rest}"], delta[key]), key
    assert all(np.array_equal(grown[k], wheel9[k]) for k in wheel9 if k.startswith("layers.0."))
    with pytest.raises(SystemExit, match="needs --init-from"):
        _train_tiny(pack_dir, cache9, tmp_path / "alone", "--upper", "3", "--new-lower-layers", "1")
    with pytest.raises(SystemExit, match="not a delta of 3 joint layers"):  # the counts must add up
        _train_tiny(pack_dir, cache9, tmp_path / "mismatch", "--upper", "3", "--init-from", str(tmp_path / "delta.npz"),
                    "--new-lower-layers", "2")


def test_a_maxsim_head_term_is_trained_exported_and_served(tmp_path: Path, e5_int8_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # --maxsim adds a learned weight times MaxSim over the joint layers' token states to the
    # head. From a delta without it at weight 0 the model is that delta; trained, the exported
    # graph computes the same term (fp32 parity with torch) and the int8 build serves it.
    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.models.onnx_cross_encoder import load_cross_encoder
    from service.offline.builder.reranker import save_delta
    from service.offline.training.split_export import export

    pack_dir, cache = _pack_and_cache(tmp_path, e5_int8_dir, monkeypatch)
    _, plain = _train_tiny(pack_dir, cache, tmp_path / "plain", "--lr", "1e-3")
    delta = save_delta(plain, tmp_path / "delta.npz")
    meta, still = _train_tiny(pack_dir, cache, tmp_path / "still", "--lr", "0", "--maxsim",
                              "--init-from", str(tmp_path / "delta.npz"))
    assert meta["maxsim"] is True and float(still.pop("maxsim_w")) == 0.0
    assert max(float(np.abs(still[k] - delta[k]).max()) for k in delta) == 0.0
    meta, trained = _train_tiny(pack_dir, cache, tmp_path / "run", "--lr", "1e-3", "--maxsim", "--maxsim-init", "5")
    assert float(trained["maxsim_w"]) != 5.0  # it learns

    report = export(tmp_path / "run", tmp_path / "models" / "maxsim", pack_dir, e5_int8_dir, parity_questions=2,
                    calibration_questions=2, log=lambda m: None)
    assert report["variants"]["fp32"]["max_abs_diff_vs_torch"] < 1e-3
    runner = load_cross_encoder(tmp_path / "models" / "maxsim-int8", threads=1)
    pairs = [("how are pet insurance premiums set?", "Premiums for pet insurance depend on your risk profile."),
             ("how are pet insurance premiums set?", "Cancelling car insurance early may cost a fee.")]
    scores = runner.infer(runner.tokenize(pairs))
    assert scores.shape == (2,) and np.isfinite(scores).all()


def test_towers_train_with_in_batch_negatives_and_score_as_the_cut_joint_forward(
        tmp_path: Path, e5_int8_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --towers cuts the cross attention for good (bias -1e4, no gradient) and scores each
    # question against every passage of the step. The towers' dot products then equal the
    # joint forward's logits, which evaluation and export run.
    pytest.importorskip("torch", reason=TORCH_REASON)
    import torch

    from service.offline.training.split import (TOWERS_CUT_BIAS, SplitLayout, forward_pairs, in_batch_loss, load_cache,
                                                load_source, make_upper, tower_vectors)

    pack_dir, cache = _pack_and_cache(tmp_path, e5_int8_dir, monkeypatch)
    meta, trained = _train_tiny(pack_dir, cache, tmp_path / "towers", "--towers", "--lr", "1e-3")
    _, still = _train_tiny(pack_dir, cache, tmp_path / "still", "--lr", "0")
    assert float(np.abs(trained["cross_bias"] - TOWERS_CUT_BIAS).max()) == 0.0
    assert float(np.abs(trained["layers.0.q.weight"] - still["layers.0.q.weight"]).max()) > 0.0  # it learns
    with pytest.raises(SystemExit, match="--towers"):
        _run_tiny(pack_dir, cache, tmp_path / "refused", "--towers", "--maxsim")

    torch.manual_seed(0)
    model = make_upper(load_source("e5"), SplitLayout(10, 64, 192), 2, 0.0, TOWERS_CUT_BIAS, 20.0)
    model.eval()
    states = load_cache(cache, ["user"])["user"]
    qs = [np.asarray(states.train_q[i]) for i in range(2)]
    ps = [np.asarray(states.docs[i]) for i in range(4)]
    with torch.no_grad():
        qv, pv = tower_vectors(model, qs, 1, False), tower_vectors(model, ps, 3, False)
        towers = (qv * model.head_w) @ pv.T + model.head_b
        joint = forward_pairs(model, [q for q in qs for _ in ps], ps * len(qs), 3, False).view(len(qs), len(ps))
        assert float((towers - joint).abs().max()) < 1e-3
        # The loss: question i's own positive is column i * group; a column marked as another
        # judged answer of question i is dropped from its softmax, not counted as a negative.
        same = np.zeros((2, 4), dtype=np.bool_)
        plain = in_batch_loss(model, qs, ps, 2, same, 3, False)
        assert float(plain) == pytest.approx(float(torch.nn.functional.cross_entropy(towers, torch.tensor([0, 2]))), abs=1e-4)
        same[0, 3] = True
        masked = in_batch_loss(model, qs, ps, 2, same, 3, False)
        expect = (torch.nn.functional.cross_entropy(towers[0:1, :3], torch.tensor([0]))
                  + torch.nn.functional.cross_entropy(towers[1:2], torch.tensor([2]))) / 2
        assert float(masked) == pytest.approx(float(expect), abs=1e-4)


def test_only_weights_with_the_cross_attention_cut_ship_as_towers() -> None:
    from service.offline.training.split import TOWERS_CUT_BIAS
    from service.offline.training.split_export import trained_as_towers

    cut = np.full((3, 12), TOWERS_CUT_BIAS, np.float32)
    assert trained_as_towers({"cross_bias": cut})
    shut = cut.copy()
    shut[2, 5] = -6.5  # shut but learned: the joint graph's, until a towers gate says otherwise
    assert not trained_as_towers({"cross_bias": shut})


def test_distillation_term_follows_the_teacher_and_skips_unscored_groups() -> None:
    pytest.importorskip("torch", reason=TORCH_REASON)
    import torch

    from service.offline.training.split import distill_loss

    teacher = {"en": {(0, 5): 3.0, (0, 6): 1.0, (0, 7): -2.0, (1, 5): 0.0}}
    batch, docs = [("en", 0), ("en", 1)], [[5, 6, 7], [5, 6, 7]]  # question 1: two pairs unscored
    same = torch.tensor([[3.0, 1.0, -2.0], [9.0, -9.0, 0.0]], requires_grad=True)
    assert float(distill_loss(same, teacher, batch, docs, 1.0)) == pytest.approx(0.0, abs=1e-6)
    flipped = torch.tensor([[-2.0, 1.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    loss = distill_loss(flipped, teacher, batch, docs, 1.0)
    assert float(loss) > 1.0
    loss.backward()
    assert flipped.grad is not None and float(flipped.grad[1].abs().sum()) == 0.0  # the unscored group adds nothing
    assert float(flipped.grad[0, 0]) < 0.0  # pushes the teacher's favourite up
    none = distill_loss(flipped, teacher, [("en", 1)], [[5, 6, 7]], 1.0)
    assert float(none) == 0.0


def test_teacher_only_trains_on_the_questions_the_teacher_scored(tmp_path: Path, e5_int8_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A teacher that scored a prefix of the questions (a cut run, a cross-lingual sample):
    # --teacher-only keeps the groups it can teach, the others would learn from labels alone.
    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.offline.training.data import load_pack
    from service.offline.training.split import main as split_main
    from service.offline.training.teacher import question_pairs

    pack_dir, cache = _pack_and_cache(tmp_path, e5_int8_dir, monkeypatch)
    off, doc = question_pairs(load_pack(pack_dir), "user")
    scored = 3
    np.savez(tmp_path / "teacher.npz", user_off=off[: scored + 1], user_doc=doc[: off[scored]],
             user_score=np.linspace(1, -1, int(off[scored])).astype(np.float16), user_done=np.int64(scored),
             meta=np.array(json.dumps({"report": {"user": {"scored": scored}}, "layers": 12})))

    def train(out: Path, *extra: str) -> dict[str, object]:
        split_main(["train", "--pack", str(pack_dir), "--cache", str(cache), "--out", str(out), "--group", "3",
                    "--batch-groups", "1", "--final-eval-questions", "1", "--eval-depth", "8", "--fp32",
                    "--threads", "1", "--epochs", "1", "--teacher", str(tmp_path / "teacher.npz"), *extra])
        return dict(json.loads((out / "split-weights.json").read_text()))

    everything = train(tmp_path / "all")
    assert everything["groups_per_pass"] == 7 and everything["steps"] == 7
    only = train(tmp_path / "only", "--teacher-only")
    assert only["groups_per_pass"] == scored and only["steps"] == scored


def test_null_column_gives_the_logit_a_level() -> None:
    # Plain listwise softmax cannot tell a list with no answer: shifting every logit of a
    # question changes nothing. The "no answer" column at a fixed logit can.
    pytest.importorskip("torch", reason=TORCH_REASON)
    import torch

    from service.offline.training.split import null_column_losses

    answerable = torch.tensor([[2.0, 0.0, -1.0]])
    low, high = torch.tensor([[-4.0, -5.0, -6.0]]), torch.tensor([[1.0, 0.0, -1.0]])
    a_low, n_low = null_column_losses(answerable, low, -2.0)
    _, n_high = null_column_losses(answerable, high, -2.0)
    assert float(n_low) < 0.2 < 2.0 < float(n_high)  # candidates above the column: a large loss
    shifted, _ = null_column_losses(answerable - 5.0, low, -2.0)
    assert float(shifted) > float(a_low) + 1.0  # and an answer below the column costs too
    expect = torch.nn.functional.cross_entropy(torch.tensor([[-2.0, 2.0, 0.0, -1.0]]), torch.tensor([1]))
    assert float(a_low) == pytest.approx(float(expect))
    high.requires_grad_(True)
    null_column_losses(answerable, high, -2.0)[1].backward()
    assert high.grad is not None and bool((high.grad > 0).all())  # every candidate of the list goes down


def test_null_questions_use_a_gibberish_seed_of_their_own(tmp_path: Path) -> None:
    from service.eval.answerability import TEST_GIBBERISH_SEED, gibberish, off_domain_training
    from service.offline.training.pack import null_questions

    path = tmp_path / "nulls.json"
    path.write_text(json.dumps({"_about": "x", "en": ["how do I tune a guitar"], "zh": ["怎么给吉他调音"]}))
    got = null_questions(path, 3)
    assert got["en"][0] == "how do I tune a guitar" and len(got["en"]) == 4 and len(got["zh"]) == 4
    used = {*gibberish(20, "en", TEST_GIBBERISH_SEED), *off_domain_training().queries.values()}
    assert not set(got["en"][1:]) & used and not set(got["zh"][1:]) & used


def test_lists_with_no_answer_are_packed_cached_and_trained(tmp_path: Path, e5_int8_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from service.offline.training.data import load_pack
    from service.offline.training.pack import build_pack

    monkeypatch.setenv("RETRIEVAL_EMBEDDINGS_CACHE", str(tmp_path / "emb-cache"))
    pack_dir = tmp_path / "pack"
    nulls = ["what is the capital of mongolia", "how do I tune a guitar", "who painted the mona lisa"]
    build_pack(pack_dir, ("user",), valid_questions=2, bm25_negatives=4, dense_negatives=4, shipped_negatives=1,
               candidates=8, model_dir=e5_int8_dir, judgements=_write_user_data(tmp_path), log=lambda m: None,
               null_questions={"user": nulls}, null_candidates=5)
    pack = load_pack(pack_dir)
    d = pack.langs["user"]
    assert d.null_q is not None and d.null_cand is not None and len(d.null_q) == 3
    assert all(len(d.null_cand[j]) == 5 and len(set(d.null_cand[j].tolist())) == 5 for j in range(3))
    assert pack.manifest["stats"]["user"]["null_questions"] == 3
    (tmp_path / "plain").mkdir()
    plain = load_pack(_pack(tmp_path / "plain", e5_int8_dir, monkeypatch)).langs["user"]
    assert plain.null_q is None  # a pack without them loads as before
    assert len(plain.train_q) == len(d.train_q)

    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.offline.training.split import main as split_main

    cache, out = tmp_path / "cache", tmp_path / "run"
    split_main(["cache", "--pack", str(pack_dir), "--cache", str(cache), "--lower", "10"])
    assert (cache / "user_null_q.npy").exists()
    common = ["train", "--pack", str(pack_dir), "--cache", str(cache), "--out", str(out), "--group", "3",
              "--batch-groups", "2", "--final-eval-questions", "2", "--eval-depth", "8", "--log-every", "1",
              "--fp32", "--threads", "1", "--epochs", "1"]
    split_main(common + ["--null-weight", "1", "--null-groups", "2", "--null-logit", "-2"])
    progress = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"progress"' in x]
    assert len(progress) == 3 and all(p["null_loss"] > 0 for p in progress)
    plain_cache = tmp_path / "plain" / "cache"
    split_main(["cache", "--pack", str(tmp_path / "plain" / "pack"), "--cache", str(plain_cache), "--lower", "10"])
    with pytest.raises(SystemExit, match="no lists with no answer"):
        split_main(["train", "--pack", str(tmp_path / "plain" / "pack"), "--cache", str(plain_cache),
                    "--out", str(tmp_path / "plain" / "run"), "--null-weight", "1", "--fp32", "--threads", "1"])
    # Answers removed needs no off-domain questions: any pack with mined negatives has them.
    # (This corpus is one template per topic, so at the default Jaccard too few negatives
    # differ enough from the answer to make a list: the test keeps the ones that differ at all.)
    removed = tmp_path / "plain" / "removed"
    split_main(["train", "--pack", str(tmp_path / "plain" / "pack"), "--cache", str(plain_cache), "--out", str(removed),
                "--group", "3", "--batch-groups", "2", "--final-eval-questions", "2", "--eval-depth", "8",
                "--log-every", "1", "--fp32", "--threads", "1", "--epochs", "1", "--null-weight", "1",
                "--null-logit", "-2", "--null-source", "answers-removed", "--null-min-candidates", "3",
                "--null-near-duplicate", "0.99"])
    progress = [json.loads(x) for x in (removed / "log.jsonl").read_text().splitlines() if '"progress"' in x]
    assert progress and all(p["null_loss"] > 0 for p in progress)


def test_answers_removed_lists_keep_only_first_stage_negatives_that_are_not_the_answer() -> None:
    from service.offline.training.data import LangData, Pack, Ragged
    from service.offline.training.pack import SRC_BM25, SRC_DENSE, SRC_SHIPPED, _csr
    from service.offline.training.split import LangStates, answers_removed_lists

    def ragged(rows: list[list[int]], dtype: type = np.uint16) -> Ragged:
        return Ragged(*_csr(rows, dtype))  # the layout the pack writes

    docs = ragged([[1, 2, 3, 4, 5],  # 0: q0's judged answer
                   [1, 2, 3, 4, 6],  # 1: the same answer reworded (Jaccard 4/6 with 0)
                   [7, 8, 9], [10, 11], [12],  # 2 BM25, 3 dense, 4 a shipped random negative
                   [1, 2, 30, 31, 32]])  # 5: shares two tokens with 0 (Jaccard 2/8)
    d = LangData("en", docs, train_q=ragged([[40], [41]]), train_pos=ragged([[0], [3]]),
                 train_neg=ragged([[1, 2, 3, 4, 5], [0, 2]]),
                 train_neg_src=ragged([[SRC_BM25, SRC_BM25, SRC_DENSE, SRC_SHIPPED, SRC_DENSE | SRC_BM25], [1, 2]],
                                      np.uint8),
                 valid_q=ragged([]), valid_cand=np.zeros((0, 1), np.int32), valid_cand_score=np.zeros((0, 1), np.float32),
                 valid_rel=np.zeros((0, 1), np.bool_), valid_nrel=np.zeros(0, np.int32))
    pack = Pack(Path("."), {}, {"en": d}, 0, 2, 1, np.arange(50))
    items = [("en", 0), ("en", 1)]
    got = answers_removed_lists(pack, items, min_candidates=2, near_duplicate=0.6)
    assert [(n.index, n.candidates.tolist()) for n in got] == [(0, [2, 3, 5]), (1, [0, 2])]
    looser = answers_removed_lists(pack, items, min_candidates=2, near_duplicate=0.7)
    assert looser[0].candidates.tolist() == [1, 2, 3, 5]  # the rewording counts as a negative again
    assert [n.index for n in answers_removed_lists(pack, items, min_candidates=3, near_duplicate=0.6)] == [0]
    states = LangStates(docs, ragged([[7], [8]]), ragged([]), None)
    assert got[1].question_states(states).tolist() == [8]  # the train question itself asks it


def test_platt_fit_on_saturated_logits() -> None:
    """Raw reranker logits sit far from 0 (20 x cosine): the fit must not diverge there."""
    from service.offline.training.split_export import fit_platt

    rng = np.random.default_rng(0)
    labels = (rng.random(6000) < 0.03).astype(np.float64)
    logits = 20.0 + 3.0 * labels + rng.normal(0.0, 1.0, 6000)  # class-conditional N(20|23, 1)
    a, c = fit_platt(logits, labels)
    assert 2.5 < a < 3.5  # the logistic slope of two unit-variance Gaussians 3 apart is 3
    p = 1.0 / (1.0 + np.exp(-(a * logits + c)))
    assert abs(p.mean() - labels.mean()) < 1e-3  # calibrated in the mean
    with pytest.raises(RuntimeError):
        fit_platt(-logits, labels)  # a model that ranks positives lower is refused


def test_bf16_autocast_only_where_the_cpu_has_avx512() -> None:
    """On AVX2 torch emulates bf16 (a split-training step took ~1 min against 3.5 s in fp32),
    so the trainer autocasts only where the CPU lists AVX512 or bf16 instructions."""
    from service.offline.training.split import bf16_native

    assert not bf16_native("flags : fpu sse4_2 avx avx2 fma f16c")
    assert bf16_native("flags : fpu avx2 avx512f avx512bw avx512_vnni")
    assert bf16_native("flags : fpu avx2 amx_bf16 amx_tile")
    assert not bf16_native("")


def _tiny_bert_source(e5_int8_dir: Path) -> object:
    """A random 2-layer BERT standing in for bge-small-en (which comes from a Maven jar): its
    own weights and first-token pooling, e5's tokenizer for the mechanics."""
    from tokenizers import Tokenizer

    from service.offline.builder.bge import BertSource
    from service.offline.builder.q4bin import BertConfig, BertWeights, LayerWeights

    tokenizer_json = (e5_int8_dir / "tokenizer.json").read_text(encoding="utf-8")
    vocab = Tokenizer.from_str(tokenizer_json).get_vocab_size()
    rng = np.random.default_rng(1)

    def m(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.3, shape).astype(np.float32)

    h, ff = 16, 32
    layers = [LayerWeights(m(h, h), m(h), m(h, h), m(h), m(h, h), m(h), m(h, h), m(h), 1 + m(h), m(h), m(h, ff), m(ff),
                           m(ff, h), m(h), 1 + m(h), m(h)) for _ in range(2)]
    weights = BertWeights(m(vocab, h), m(256, h), m(2, h), 1 + m(h), m(h), layers)
    return BertSource("tiny", BertConfig(h, 2, 2, ff, vocab, 256, 2, 1e-12), weights, 0, 2, 1, tokenizer_json, "query: ",
                      "cls")


def test_a_reranker_from_another_backbone_pools_as_it_embeds(tmp_path: Path, e5_int8_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # `split cache --source bge-small-en` caches another backbone's lower states (the pack's
    # texts re-tokenized with its tokenizer), the run records the source and its first-token
    # pooling, and untrained with cross attention shut it scores 20 x the cosine of the full
    # backbone's first-token states, as the bge embedder ranks. The second-reranker tool
    # scores served heads with it; a served reranker exports only from e5.
    pytest.importorskip("torch", reason=TORCH_REASON)
    from service.eval.head_order_fit import Head
    from service.offline.training import split
    from service.offline.training.second_reranker import head_logits
    from service.offline.training.split_export import load_run

    tiny = _tiny_bert_source(e5_int8_dir)
    real = split.load_source
    monkeypatch.setattr(split, "load_source", lambda name: tiny if name == "bge-small-en" else real(name))
    pack_dir = _pack(tmp_path, e5_int8_dir, monkeypatch)
    cache = tmp_path / "cache-bge"
    split.main(["cache", "--pack", str(pack_dir), "--cache", str(cache), "--lower", "1", "--source", "bge-small-en",
                "--lower-precision", "fp32"])
    cache_meta = json.loads((cache / "cache.json").read_text())
    assert (cache_meta["source"], cache_meta["pool"]) == ("bge-small-en", "cls")
    assert np.load(cache / "user_docs.npy").shape[1] == 16
    def train(out: Path, *extra: str) -> None:
        _run_tiny(pack_dir, cache, out, "--lower", "1", "--upper", "1", *extra)

    train(tmp_path / "run", "--lr", "0", "--cross-bias-init", "-10000")
    meta = json.loads((tmp_path / "run" / split.WEIGHTS_META).read_text())
    assert (meta["source"], meta["pool"]) == ("bge-small-en", "cls")
    with pytest.raises(SystemExit, match="only runs from e5"):
        load_run(tmp_path / "run")
    with pytest.raises(SystemExit, match="are e5's"):
        train(tmp_path / "maxsim", "--maxsim")
    from service.offline.builder.reranker import save_delta

    save_delta({k: np.asarray(v) for k, v in np.load(tmp_path / "run" / split.WEIGHTS_FILE).items()}, tmp_path / "d.npz")
    with pytest.raises(SystemExit, match="--init-from"):  # an e5 delta would load into it silently
        train(tmp_path / "continued", "--init-from", str(tmp_path / "d.npz"))

    corpus = {f"d{i}": f"{t.capitalize()} pays out when the insured event happens." for i, t in enumerate(TOPICS[:4])}
    head = Head(list(corpus), {}, {"d1"}, "how are car insurance premiums set?")
    [logits] = head_logits([head], corpus, tmp_path / "run", threads=1, int8=False, bf16=False)
    full = split.lower_session(tiny, 2, 1, int8=False)

    def pooled(texts: list[str], query: bool, first: bool = True) -> np.ndarray:
        cap = 64 if query else 192
        states = [full.run(None, {"input_ids": s[None], "attention_mask": np.ones_like(s)[None]})[0][0]
                  for s in split.source_text("bge-small-en", tiny).sequences(texts, query, cap)]
        vecs = [h[0] if first else h.mean(0) for h in states]
        return np.array([v / np.linalg.norm(v) for v in vecs])

    passages = list(corpus.values())
    expected = 20.0 * pooled(passages, False) @ pooled([head.query], True)[0]
    assert np.allclose(logits, expected, atol=1e-3), (logits, expected)
    assert np.ptp(expected) > 0.05  # 50x the tolerance: the passages are told apart
    mean_pooled = 20.0 * pooled(passages, False, first=False) @ pooled([head.query], True, first=False)[0]
    assert not np.allclose(logits, mean_pooled, atol=1e-2)  # the pooling is what the check tells apart
