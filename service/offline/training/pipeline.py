"""pack -> train -> export in one call (``python -m service models train-reranker``).

At full size (InsuranceQA en + zh, 12 layers, max length 256, ~26k groups of 16 per epoch)
this is hours per epoch on a small CPU; on one GPU it is minutes (see ``DEVICE.md``).
``--minutes`` bounds the training wall clock (the LR schedule is fitted into it), and
``--resume`` continues from the last checkpoint in ``WORK/ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def run_pipeline(*, pack: Path, work: Path, models_dir: Path, name: str, langs: str = "en,zh", device: str | None = None,
                 minutes: float | None = None, layers: int = 12, max_len: int = 256, epochs: float = 3.0,
                 group: int = 16, batch_groups: int = 32, lr: float = 5e-5, resume: bool = False, repack: bool = False,
                 seed: int = 0) -> dict[str, Any]:
    from service.offline.training.export import export
    from service.offline.training.pack import MANIFEST_FILE, build_pack
    from service.offline.training.train import parse_args, train

    if repack or not (pack / MANIFEST_FILE).is_file():
        build_pack(pack, [s for s in langs.split(",") if s], seed=seed)
    argv = ["--pack", str(pack), "--out", str(work), "--langs", langs, "--layers", str(layers), "--max-len", str(max_len),
            "--epochs", str(epochs), "--group", str(group), "--batch-groups", str(batch_groups), "--lr", str(lr),
            "--seed", str(seed)]
    if device:
        argv += ["--device", device]
    if minutes:
        argv += ["--minutes", str(minutes)]
    if resume:
        argv.append("--resume")
    metrics = train(parse_args(argv))
    report = export(work, models_dir / name, pack)
    print(f"[train-reranker] final eval: {metrics['final_eval']}", file=sys.stderr)
    return {"metrics": metrics, "export": report}


def run_split_pipeline(*, pack: Path, cache: Path, work: Path, models_dir: Path, name: str, langs: str = "en,zh",
                       minutes: float = 30.0, resume: bool = False, repack: bool = False, seed: int = 0,
                       train_questions: int | None = 6000, artifact: Path | None = None,
                       lower: int = 9, upper: int = 3, init_upper: str = "adapted", mine_with: Path | None = None,
                       extra: list[str] | None = None) -> dict[str, Any]:
    """The CPU recipe of the shipped reranker: pack (hard negatives mined with the dense leg
    of ``mine_with``, an embedding model dir; the shipped one: the InsuranceQA-adapted e5)
    -> the lower ``lower`` layers' state cache -> train the ``upper`` joint layers (initialised
    from ``init_upper``'s e5 upper layers: ``wheel`` or ``adapted``) for ``minutes`` -> ship:
    the compact artifact (delta + card) into ``artifact`` (default: the shipped one under
    service/offline/builder/artifacts, which a commit then replaces) and ``NAME-int8``
    assembled from it under ``models_dir``. Gate and quality calibration come after, from
    ``service eval`` (README)."""
    from service.offline.builder.reranker import artifact_dir
    from service.offline.training.pack import MANIFEST_FILE, build_pack
    from service.offline.training.split import main as split_main
    from service.offline.training.split_export import ship

    if repack or not (pack / MANIFEST_FILE).is_file():
        build_pack(pack, [s for s in langs.split(",") if s], seed=seed, train_questions=train_questions,
                   model_dir=mine_with)
    split_main(["cache", "--pack", str(pack), "--cache", str(cache), "--langs", langs, "--lower", str(lower)])
    argv = ["train", "--pack", str(pack), "--cache", str(cache), "--out", str(work), "--langs", langs,
            "--lower", str(lower), "--upper", str(upper), "--init-upper", init_upper,
            "--minutes", str(minutes), "--seed", str(seed), *(extra or [])]
    if resume:
        argv.append("--resume")
    split_main(argv)
    command = " ".join(sys.argv) if sys.argv else ""
    card = ship(work, pack, artifact or artifact_dir(name), models_dir, command=command)
    print(f"[train-reranker] shipped: {card['builds']}", file=sys.stderr)
    return {"card": card}
