"""Builds servable model dirs from the bge-small v1.5 embedders (BAAI, MIT) that langchain4j
ships as ONNX + tokenizer.json inside Maven jars (``dev.langchain4j:langchain4j-embeddings-
bge-small-{en,zh}-v15[-q]``). The jar is fetched with ``mvn dependency:get`` into the local
Maven repository (~/.m2) when it is not there yet; nothing else is downloaded.

The jars' graphs take ``input_ids``, ``attention_mask`` and ``token_type_ids`` and return
``last_hidden_state``. The service's embedder contract is "the graph pools and normalises"
(e5's graph does mean pooling + L2 in ONNX), so rather than teaching ``OnnxEmbedder`` a
second pooling mode we append the pooling to the graph: CLS (token 0) then L2, as bge is
trained, output ``sentence_embedding``; ``token_type_ids`` becomes an in-graph zero tensor
shaped like ``input_ids`` (single-segment input always has type 0). One runtime code path
serves both families and the manifest's ``pooling`` field stays descriptive.

The build is deterministic: same jar -> same ONNX bytes (``onnx_sha256`` in the manifest,
the jar's sha256 in ``source``), so the embedding cache and the attempt ledger's model hash
stay stable across machines.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.models.manifest import MANIFEST, MODEL_FILE, TOKENIZER_FILE, publish_model_dir, sha256_file, write_manifest
from service.offline.builder.bert_graph import EMBEDDING_OUTPUT
from service.offline.builder.e5 import Log, _stderr
from service.offline.builder.q4bin import BertConfig, BertWeights, LayerWeights
from service.offline.builder.reranker import ArtifactMismatch

GROUP = "dev.langchain4j"
VERSION = "0.36.2"
# Bump when the graph surgery, tokenizer settings or manifest recipe change: forces a rebuild.
BUILDER_VERSION = 1
MAX_LENGTH = 512
HIDDEN_OUTPUT = "last_hidden_state"

# bge v1.5's retrieval instructions (its model card): prepended to short queries only;
# passages get no prefix.
INSTRUCTION_EN = "Represent this sentence for searching relevant passages: "
INSTRUCTION_ZH = "为这个句子生成表示以用于检索相关文章："


@dataclass(frozen=True)
class BgeVariant:
    """One model dir to build: which jar, and which query prefix its manifest carries."""

    model_id: str
    artifact: str
    lang: str
    precision: str  # "fp32" or "int8" (the jar's "-q": dynamically quantised upstream)
    query_prefix: str

    @property
    def stem(self) -> str:
        """Name of the ONNX and tokenizer files inside the jar."""
        lang_part = f"bge-small-{self.lang}-v1.5"
        return f"{lang_part}-q" if self.artifact.endswith("-q") else lang_part


def _variant(lang: str, precision: str, instruction: bool) -> BgeVariant:
    artifact = f"langchain4j-embeddings-bge-small-{lang}-v15" + ("-q" if precision == "int8" else "")
    prefix = (INSTRUCTION_EN if lang == "en" else INSTRUCTION_ZH) if instruction else ""
    suffix = "" if instruction else "-noinst"
    return BgeVariant(f"bge-small-{lang}-v1.5-{precision}{suffix}", artifact, lang, precision, prefix)


VARIANTS: dict[str, BgeVariant] = {
    v.model_id: v
    for lang in ("en", "zh")
    for precision in ("int8", "fp32")
    for instruction in (True, False)
    for v in [_variant(lang, precision, instruction)]
}


def maven_repo() -> Path:
    return Path.home() / ".m2" / "repository"


def jar_path(artifact: str, repo: Path | None = None) -> Path:
    root = repo if repo is not None else maven_repo()
    return root / GROUP.replace(".", "/") / artifact / VERSION / f"{artifact}-{VERSION}.jar"


def fetch_jar(artifact: str, log: Log = _stderr) -> Path:
    """The jar from the local Maven repository, resolved with ``mvn`` when missing."""
    path = jar_path(artifact)
    if not path.is_file():
        if shutil.which("mvn") is None:
            raise FileNotFoundError(f"{path} is missing and mvn is not installed to fetch {GROUP}:{artifact}:{VERSION}")
        log(f"fetching {GROUP}:{artifact}:{VERSION} with mvn")
        subprocess.run(["mvn", "-q", "dependency:get", f"-Dartifact={GROUP}:{artifact}:{VERSION}", "-Dtransitive=false"],
                       check=True)
    if not path.is_file():
        raise FileNotFoundError(f"mvn ran but {path} is still missing")
    return path


def add_cls_pooling(model: onnx.ModelProto) -> onnx.ModelProto:
    """``last_hidden_state`` [b, t, d] -> L2-normalised token 0 [b, d] as ``sentence_embedding``;
    ``token_type_ids`` is replaced by zeros shaped like ``input_ids``."""
    graph = model.graph
    if [o.name for o in graph.output] != [HIDDEN_OUTPUT]:
        raise ValueError(f"expected one output {HIDDEN_OUTPUT!r}, found {[o.name for o in graph.output]}")
    dim = graph.output[0].type.tensor_type.shape.dim[2].dim_value
    if any(i.name == "token_type_ids" for i in graph.input):
        kept = [i for i in graph.input if i.name != "token_type_ids"]
        del graph.input[:]
        graph.input.extend(kept)
        zeros = [
            helper.make_node("Shape", ["input_ids"], ["bge_ids_shape"], name="bge_ids_shape"),
            helper.make_node("ConstantOfShape", ["bge_ids_shape"], ["token_type_ids"], name="bge_token_types",
                             value=helper.make_tensor("zero", TensorProto.INT64, [1], [0])),
        ]
        for node in reversed(zeros):
            graph.node.insert(0, node)
    graph.initializer.append(helper.make_tensor("bge_cls_index", TensorProto.INT64, [], [0]))
    graph.node.extend([
        helper.make_node("Gather", [HIDDEN_OUTPUT, "bge_cls_index"], ["bge_cls"], name="bge_cls_pool", axis=1),
        helper.make_node("LpNormalization", ["bge_cls"], [EMBEDDING_OUTPUT], name="bge_l2", axis=-1, p=2),
    ])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(EMBEDDING_OUTPUT, TensorProto.FLOAT, ["batch_size", dim]))
    onnx.checker.check_model(model)
    return model


def serving_tokenizer(raw: str) -> str:
    """The jar's tokenizer.json with its pad token declared ([PAD]); ``load_tokenizer``
    reads the pad id from the padding settings, and the jars ship none."""
    tok: dict[str, Any] = json.loads(raw)
    pad_id = tok["model"]["vocab"]["[PAD]"]
    tok["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                      "pad_id": pad_id, "pad_type_id": 0, "pad_token": "[PAD]"}
    tok["truncation"] = None
    return json.dumps(tok, ensure_ascii=False)


ARTIFACTS = Path(__file__).with_name("artifacts")
CARD_FILE = "card.json"


def shipped_cards() -> list[dict[str, Any]]:
    """The committed cards of bge builds that ``make models`` produces (artifacts/<model id>/
    card.json with ``"family": "bge"``): which jar (pinned by sha256) and which ONNX it must give."""
    cards = []
    for path in sorted(ARTIFACTS.glob(f"*/{CARD_FILE}")):
        card: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if card.get("family") == "bge":
            cards.append(card)
    return cards


def build_shipped(out_dir: Path, force: bool = False, log: Log = _stderr) -> list[Path]:
    """Build every carded bge model, checking the jar against the card's pin before use and
    the built ONNX against the card's hash after (the build is deterministic). Without the
    jar and without mvn to fetch it, the model is skipped with a note: nothing serves it by
    default, so a machine without Maven still gets every model the service needs."""
    built = []
    for card in shipped_cards():
        variant = VARIANTS[card["name"]]
        try:
            jar = fetch_jar(variant.artifact, log)
        except (FileNotFoundError, subprocess.CalledProcessError) as exc:
            log(f"{variant.model_id}: skipped ({exc})")
            continue
        jar_sha = sha256_file(jar)
        if jar_sha != card["source"]["jar_sha256"]:
            raise ArtifactMismatch(f"{jar}: sha256 {jar_sha}, the card pins {card['source']['jar_sha256']}")
        [model_dir] = build_bge(out_dir, (variant.model_id,), force=force, log=log)
        onnx_sha = json.loads((model_dir / MANIFEST).read_text(encoding="utf-8"))["onnx_sha256"]
        if onnx_sha != card["onnx_sha256"]:
            raise ArtifactMismatch(f"{model_dir}: built ONNX sha256 {onnx_sha}, the card pins {card['onnx_sha256']}")
        built.append(model_dir)
    return built


def is_current(model_dir: Path, source_sha256: str, query_prefix: str) -> bool:
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        manifest.get("source", {}).get("sha256") == source_sha256
        and manifest.get("builder_version") == BUILDER_VERSION
        and manifest.get("query_prefix") == query_prefix
        and (model_dir / MODEL_FILE).is_file()
        and (model_dir / TOKENIZER_FILE).is_file()
    )


def build_bge(out_dir: Path, model_ids: tuple[str, ...], force: bool = False, log: Log = _stderr) -> list[Path]:
    """Build the named variants (keys of ``VARIANTS``) under ``out_dir``; skips current ones."""
    built = []
    for model_id in model_ids:
        variant = VARIANTS[model_id]
        jar = fetch_jar(variant.artifact, log)
        source_sha = sha256_file(jar)
        final = out_dir / model_id
        if not force and is_current(final, source_sha, variant.query_prefix):
            log(f"{model_id}: up to date, skipping")
        else:
            _build_variant(variant, jar, source_sha, final, log)
        built.append(final)
    return built


def _build_variant(variant: BgeVariant, jar: Path, source_sha: str, final: Path, log: Log) -> None:
    t0 = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        with zipfile.ZipFile(jar) as z:
            model = onnx.load_from_string(z.read(f"{variant.stem}.onnx"))
            tokenizer = z.read(f"{variant.stem}-tokenizer.json").decode("utf-8")
        model = add_cls_pooling(model)
        dimension = model.graph.output[0].type.tensor_type.shape.dim[1].dim_value
        onnx.save(model, str(work / MODEL_FILE))
        (work / TOKENIZER_FILE).write_text(serving_tokenizer(tokenizer), encoding="utf-8")
        manifest: dict[str, Any] = {
            "model_id": variant.model_id,
            "kind": "embedding",
            "precision": variant.precision,
            "language": variant.lang,
            "source": {"maven": f"{GROUP}:{variant.artifact}:{VERSION}", "file": f"{variant.stem}.onnx",
                       "sha256": source_sha, "license": "MIT", "upstream": f"BAAI/bge-small-{variant.lang}-v1.5"},
            "onnx_sha256": sha256_file(work / MODEL_FILE),
            "dimension": dimension,
            "max_length": MAX_LENGTH,
            "pooling": "cls",
            "normalize": True,
            "query_prefix": variant.query_prefix,
            "passage_prefix": "",
            "output": EMBEDDING_OUTPUT,
            "builder_version": BUILDER_VERSION,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
        write_manifest(work, manifest)
        publish_model_dir(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{final.name}: built in {time.perf_counter() - t0:.1f}s ({(final / MODEL_FILE).stat().st_size / 1e6:.0f} MB)")


# -- bge as a split reranker's backbone (offline: split training reads its fp32 weights) -------

_LINEARS = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
            "ao": "attention.output.dense", "fi": "intermediate.dense", "fo": "output.dense"}


def bert_weights(model: onnx.ModelProto, heads: int) -> tuple[BertConfig, BertWeights]:
    """The fp32 weights of a Hugging Face BERT exported to ONNX (the jars' graphs): LayerNorms,
    biases and embeddings keep their module names, but the export names each linear's weight
    ``onnx::MatMul_N``; it is the constant operand of the MatMul whose output the named bias is
    added to. Matrices come out ``[in, out]`` like every ``LayerWeights``. The weights do not
    say how many attention heads split the hidden size (the graph's reshapes do, as computed
    shapes): ``heads`` comes from the model's config."""
    init = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    named = dict(init)
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in init:
            continue
        biases = [i for c in consumers.get(node.output[0], []) if c.op_type == "Add" for i in c.input
                  if i in init and i.endswith(".bias")]
        if len(biases) != 1:
            raise ValueError(f"MatMul {node.name or node.output[0]}: no single named bias is added to it")
        named[biases[0][: -len(".bias")] + ".weight"] = init[node.input[1]]
    n_layers = 0
    while f"encoder.layer.{n_layers}.output.LayerNorm.weight" in named:
        n_layers += 1
    if not n_layers:
        raise ValueError("not a BERT export: no encoder.layer.0")
    layers = []
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        parts: dict[str, npt.NDArray[np.float32]] = {}
        for short, module in _LINEARS.items():
            parts[f"{short}_w"] = named[p + module + ".weight"]
            parts[f"{short}_b"] = named[p + module + ".bias"]
        for short, module in (("aln", "attention.output.LayerNorm"), ("oln", "output.LayerNorm")):
            parts[f"{short}_w"] = named[p + module + ".weight"]
            parts[f"{short}_b"] = named[p + module + ".bias"]
        layers.append(LayerWeights(**parts))
    word, position, token_type = (named[f"embeddings.{n}_embeddings.weight"] for n in ("word", "position", "token_type"))
    hidden = word.shape[1]
    if hidden % heads:
        raise ValueError(f"{heads} heads do not divide the hidden size {hidden}")
    config = BertConfig(hidden, n_layers, heads, layers[0].fi_w.shape[1], word.shape[0], position.shape[0],
                        token_type.shape[0], 1e-12)
    return config, BertWeights(word, position, token_type, named["embeddings.LayerNorm.weight"],
                               named["embeddings.LayerNorm.bias"], layers)


@dataclass(frozen=True)
class BertSource:
    """What split training needs of a backbone other than e5: weights, special ids, its tokenizer
    and query prefix, and how its embedding pools (bge: the first token)."""

    name: str
    config: BertConfig
    weights: BertWeights
    bos: int
    eos: int
    pad: int
    tokenizer_json: str
    query_prefix: str
    pool: str


def bge_source(lang: str = "en", log: Log = _stderr) -> BertSource:
    """bge-small v1.5 from its fp32 jar (fetched with mvn when missing), for split training."""
    variant = VARIANTS[f"bge-small-{lang}-v1.5-fp32"]
    heads = {"en": 12, "zh": 8}[lang]  # the models' config.json (384 = 12 x 32, 512 = 8 x 64)
    with zipfile.ZipFile(fetch_jar(variant.artifact, log)) as z:
        model = onnx.load_from_string(z.read(f"{variant.stem}.onnx"))
        tokenizer = z.read(f"{variant.stem}-tokenizer.json").decode("utf-8")
    config, weights = bert_weights(model, heads)
    vocab = json.loads(tokenizer)["model"]["vocab"]
    return BertSource(f"bge-small-{lang}", config, weights, vocab["[CLS]"], vocab["[SEP]"], vocab["[PAD]"], tokenizer,
                      variant.query_prefix, "cls")
