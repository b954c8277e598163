"""A second split reranker beside the served one: what its logit adds to the served head order.

    python -m service.offline.training.second_reranker --items RUN/int8-hybrid+rerank.items.json \\
        --split valid --lang en --run .cache/bger/run --order MODELS/e5-small-split-reranker-int8/rerank_order.json

The item dump of a ``service eval`` hybrid+rerank run holds each question's reranked head as
the server ordered it, with every signal the order weighs. This scores the same (question,
passage) pairs with a ``split train`` run (any source: e5, or bge-small-en from its jar),
passages read from the judged set's corpus (whole InsuranceQA answers, as the pack holds
them), and prints the served order's nDCG@10 against the served order plus ``w`` times the
second reranker's min-max normalised logit, with paired 95 % bootstrap intervals. The
weights are swept on the dump it reads: run it on train dumps to choose, on valid to report.
Offline only: nothing served reads a second reranker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from service.eval.head_order_fit import Head, load_heads, paired_ci
from service.eval.metrics import ndcg_at_k
from service.offline.training.data import Ragged
from service.pipeline.head_order import SCRIPTS, HeadOrder, normalised


def _log(msg: str) -> None:
    print(f"[second-reranker] {msg}", file=sys.stderr, flush=True)


def head_logits(heads: list[Head], corpus: dict[str, str], run: Path, threads: int = 2, int8: bool = True,
                bf16: bool | None = None) -> list[list[float]]:
    """The run's logit for every (question, head passage) pair, per head in the head's order.
    ``int8``: the lower layers quantised as its cache's were (``split cache`` default);
    ``bf16``: autocast the joint layers (default: where the CPU has AVX-512, as training did)."""
    import torch

    from service.offline.training.split import (
        WEIGHTS_FILE,
        WEIGHTS_META,
        LangStates,
        SplitLayout,
        bf16_native,
        encode_states,
        load_source,
        lower_session,
        make_upper,
        score_pairs,
        source_text,
    )

    meta = json.loads((run / WEIGHTS_META).read_text(encoding="utf-8"))
    source, pool = meta.get("source", "e5"), meta.get("pool", "mean")
    layout = SplitLayout(**meta["layout"])
    src = load_source(source)
    text = source_text(source, src)
    session = lower_session(src, layout.lower, threads, int8=int8)
    queries = sorted({h.query for h in heads})
    passages = sorted({d for h in heads for d in h.ids})
    missing = [d for d in passages if d not in corpus]
    if missing:
        raise SystemExit(f"{len(missing)} head passages are not in the judged corpus (e.g. {missing[0]}): another split or set?")
    q_index = {q: i for i, q in enumerate(queries)}
    p_index = {d: i for i, d in enumerate(passages)}
    _log(f"{source} lower states: {len(queries)} questions, {len(passages)} passages")
    q_rag = Ragged(*encode_states(session, text.sequences(queries, True, layout.query_max_tokens), text.pad))
    p_rag = Ragged(*encode_states(session, text.sequences([corpus[d] for d in passages], False, layout.passage_max_tokens),
                                  text.pad))
    model = make_upper(src, layout, int(meta["upper"]), 0.0, -6.0, 20.0, bool(meta.get("maxsim")), 0.0, pool)
    with np.load(run / WEIGHTS_FILE) as z:
        model.load_state_dict({k: torch.from_numpy(z[k].astype(np.float32)) for k in z.files})
    pairs = [(q_index[h.query], p_index[d]) for h in heads for d in h.ids]
    flat = score_pairs(model, LangStates(p_rag, q_rag, q_rag), q_rag, pairs, bf16_native() if bf16 is None else bf16)
    out, k = [], 0
    for h in heads:
        out.append([float(v) for v in flat[k : k + len(h.ids)]])
        k += len(h.ids)
    return out


def per_question(heads: list[Head], order: HeadOrder, cjk: bool, extra: list[list[float]], weight: float) -> list[float]:
    """nDCG@10 per head of ``order`` plus ``weight`` x the min-max normalised extra logit."""
    out = []
    for h, logits in zip(heads, extra):
        keys = [s + weight * x for s, x in zip(order.scores(h.signals, cjk), normalised(logits))]
        ranked = sorted(range(len(keys)), key=lambda i: -keys[i])
        out.append(ndcg_at_k([h.ids[i] for i in ranked], h.relevant, 10))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.offline.training.second_reranker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=Path, required=True, help="a hybrid+rerank item dump of `service eval`")
    p.add_argument("--split", choices=["train", "valid"], required=True, help="the InsuranceQA split the dump asked")
    p.add_argument("--lang", choices=["en", "zh"], required=True)
    p.add_argument("--run", type=Path, required=True, help="a `split train` output dir")
    p.add_argument("--order", type=Path, required=True, help="the served rerank_order.json")
    p.add_argument("--weights", default="0.3,0.55,0.8,1.1,1.5", help="weights of the second logit to sweep")
    p.add_argument("--lower-precision", choices=["int8", "fp32"], default="int8",
                   help="the lower layers' precision, as the run's cache had them")
    p.add_argument("--out", type=Path, default=None, help="write the per-head logits (JSON) here")
    a = p.parse_args(argv)
    from service.eval.datasets import load_insuranceqa

    heads = load_heads(a.items)
    if not heads or not all(h.query for h in heads):
        raise SystemExit(f"{a.items}: no reranked heads with their questions")
    extra = head_logits(heads, load_insuranceqa(a.split, a.lang).corpus, a.run,
                        int8=a.lower_precision == "int8")
    if a.out is not None:
        a.out.write_text(json.dumps({"items": str(a.items), "run": str(a.run), "logits": extra}))
    order = HeadOrder.load(a.order)
    cjk = a.lang == "zh"
    base = per_question(heads, order, cjk, extra, 0.0)
    print(f"{len(heads)} heads; served order {statistics.fmean(base):.4f}")
    nothing = HeadOrder({script: {} for script in SCRIPTS})  # every key 0: the second logit alone orders
    print(f"second reranker alone {statistics.fmean(per_question(heads, nothing, cjk, extra, 1.0)):.4f}")
    for w in (float(x) for x in a.weights.split(",")):
        v = per_question(heads, order, cjk, extra, w)
        mean, lo, hi = paired_ci(v, base)
        print(f"served order + {w:g} x second logit: {statistics.fmean(v):.4f}, {mean:+.4f} ({lo:+.4f}..{hi:+.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
