"""Cross-encoder reranking from a built model dir (``kind: cross-encoder``).

Two layouts, told apart by the manifest's ``architecture``:

- ``joint`` (default): one sequence ``<s> q </s></s> p </s>`` through every layer;
- ``split``: the trained reranker (``builder/split_graph.py``): the query ``<s> query: q </s>``
  and the passage ``<s> passage: p </s>`` are separate inputs; the graph runs the lower
  layers on each and the upper layers on both together. When the model dir also has the
  two-graph layout (``lower.onnx``: ids -> states at the split point; ``joint.onnx``: both
  sides' states -> logit), stored passage states (``passage_states.py``) replace the
  passage's lower layers: a rerank then runs the query's lower layers once and the joint
  layers per pair. Pairs without stored states get theirs computed in the same call.
  Where the manifest's ``scoring`` is "towers" (``towers.py``, README "Two towers"), the
  upper layers run on each side alone (``tower.onnx``): a passage's stored form is its
  tower vector, and a rerank runs the query's layers once and a dot product per pair.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from service.models._ort import batch_invariant, load_tokenizer, make_session, pad_batch
from service.models.base import CrossEncoderBackend, Encoded, FloatArray, ModelInfo, pad_rows, pad_states
from service.models.manifest import MODEL_FILE, TOKENIZER_FILE, read_manifest
from service.models.passage_states import STATES_TEXT, StatesCodec
from service.models.towers import SCORING_TOWERS, load_tower_head, served_scoring, tower_logits

T = TypeVar("T")


def passage_cap(manifest: dict[str, object], max_length: int | None, passage_tokens: int) -> int | None:
    """Tokens of a passage a split reranker reads (``rerank_passage_tokens``; 0 = its trained
    cap; ``rerank_max_length`` and the model's own limit bound both); None for a reranker
    without a passage cap (a joint one)."""
    if passage_tokens < 0:
        raise ValueError(f"rerank_passage_tokens must be 0 (the trained cap) or more, not {passage_tokens}")
    if "passage_max_tokens" not in manifest:
        return None
    limit = int(str(manifest["max_length"]))
    cap = min(max_length or limit, limit, int(str(manifest["passage_max_tokens"])))
    return min(cap, passage_tokens) if passage_tokens > 0 else cap


class OnnxCrossEncoder(CrossEncoderBackend):
    """Pairs go through the tokenizer's pair template (``[CLS] q [SEP] p [SEP]``).
    Truncation is "only second" done by hand: the query is clipped to half the budget and
    the passage gets the rest, so a pair's tokens never depend on the other pairs in its
    batch and a long query cannot make the pair untruncatable. Thread-safe, like
    ``OnnxEmbedder``."""

    def __init__(self, model_dir: Path, threads: int = 1, max_length: int | None = None,
                 compact_states: bool = False, parallel: int = 1, passage_tokens: int = 0,
                 scoring: str = "auto") -> None:
        # The two-graph path runs one call per length group; ``parallel`` > 1 runs them on a
        # pool of that many threads (onnxruntime releases the GIL), so a single rerank on an
        # idle machine uses every core, and, the pool being shared by every caller, the groups
        # of concurrent reranks never run on more threads than that. The groups, and so the
        # logits, are the same whatever ``parallel`` is.
        self._fanout = (concurrent.futures.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="rerank-group")
                        if parallel > 1 else None)
        manifest = read_manifest(model_dir, "cross-encoder")
        limit = int(manifest["max_length"])
        self.max_length = min(max_length or limit, limit)
        self.max_query_tokens = self.max_length // 2
        self.info = ModelInfo(
            model_id=str(manifest["model_id"]),
            kind="cross-encoder",
            sha256=str(manifest["onnx_sha256"]),
            max_length=self.max_length,
        )
        self._tokenizer, self._pad_id = load_tokenizer(model_dir / TOKENIZER_FILE)
        self.split = manifest.get("architecture", "joint") == "split"
        if self.split:
            self._split_init(manifest, passage_tokens)
        # Tokens left for query + passage once the template's specials are in.
        self._pair_budget = self.max_length - self._tokenizer.num_special_tokens_to_add(True)
        if self._pair_budget - self.max_query_tokens < 1:
            raise ValueError(f"max_length {self.max_length} leaves no room for the passage")
        self._one_graph_file, self._threads = model_dir / MODEL_FILE, threads
        self.batch_invariant = batch_invariant(self._one_graph_file)
        states = manifest.get("states")
        # "joint" or "towers": how the two-graph layout scores (``served_scoring``).
        self.scoring = served_scoring(manifest, scoring)
        if self.split and isinstance(states, dict):
            self._lower = make_session(model_dir / str(states["lower_file"]), threads)
            # What makes a stored blob usable: the graphs that wrote it (the lower one, then the
            # tower or the projection), the format and the passage layout it encodes.
            key = f"{self.info.model_id}:lower-{str(states['lower_onnx_sha256'])[:16]}"
            if self.scoring == SCORING_TOWERS:
                self._tower = make_session(model_dir / str(states["tower_file"]), threads)
                self._head_w, self._head_b = load_tower_head(model_dir / str(states["tower_head_file"]))
                self._codec = StatesCodec(vectors=True)  # a vector is already small: no projection
                key += f":tower-{str(states['tower_onnx_sha256'])[:16]}"
            else:
                self._joint = make_session(model_dir / str(states["joint_file"]), threads)
                # compact: the artifact's down-projection (when it has one); else full width.
                projection = states.get("projection_file") if compact_states else None
                self._codec = StatesCodec.load(model_dir / str(projection) if projection else None)
                key += f":proj-{str(states.get('projection_sha256', ''))[:16] if projection else 'none'}"
            self.states_key = f"{key}:f{self._codec.fmt}:{STATES_TEXT}"
            if self._passage_max < int(str(manifest["passage_max_tokens"])):
                # States cut at another passage cap are other states (the lower layers saw
                # other text): never read across caps. The trained cap keeps the old key.
                self.states_key += f":cap-{self._passage_max}"
        # The one graph serves every rerank of a model without the two graphs. With them it
        # only answers ``tokenize`` + ``infer`` called directly (parity checks, the one-graph
        # baselines), so it loads on first use: a server never holds it (~127 MB resident).
        self._session: Any = None if self.states_key is not None else make_session(self._one_graph_file, threads)
        self._session_lock = threading.Lock()
        # Split graphs take no token types; a joint graph says whether it does.
        self._token_types = self._session is not None and "token_type_ids" in {
            i.name for i in self._session.get_inputs()}

    def _one_graph(self) -> Any:
        if self._session is None:
            with self._session_lock:
                if self._session is None:
                    self._session = make_session(self._one_graph_file, self._threads)
        return self._session

    def _split_init(self, manifest: dict[str, object], passage_tokens: int) -> None:
        tok = self._tokenizer
        self.max_query_tokens = int(str(manifest["query_max_tokens"]))
        self._passage_max = passage_cap(manifest, self.max_length, passage_tokens) or 0
        self._lower_layers = int(str(manifest.get("lower_layers", 0)))
        self._query_prefix = tok.encode(str(manifest["query_prefix"]), add_special_tokens=False).ids
        self._passage_prefix = tok.encode(str(manifest["passage_prefix"]), add_special_tokens=False).ids
        if self._passage_max < 3 + len(self._passage_prefix):
            raise ValueError(f"passage cap {self._passage_max} leaves no room for a passage token")
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        if bos is None or eos is None:
            raise ValueError("split cross-encoder needs <s> and </s> in its tokenizer")
        self._bos, self._eos = int(bos), int(eos)

    def _assemble(self, body: list[int], prefix: list[int], cap: int) -> list[int]:
        # Exactly the trainer's layout (training/split.py ``assemble``).
        return [self._bos, *prefix, *body[: max(0, cap - 2 - len(prefix))], self._eos]

    def _split_tokenize(self, pairs: list[tuple[str, str]]) -> Encoded:
        tok = self._tokenizer
        # One query is usually scored against many passages: tokenize each distinct one once.
        distinct = list(dict.fromkeys(q for q, _ in pairs))
        q_ids = {q: self._assemble(e.ids, self._query_prefix, self.max_query_tokens)
                 for q, e in zip(distinct, tok.encode_batch(distinct, add_special_tokens=False))}
        p_ids = [self._assemble(e.ids, self._passage_prefix, self._passage_max)
                 for e in tok.encode_batch([p for _, p in pairs], add_special_tokens=False)]
        q_rows = [q_ids[q] for q, _ in pairs]
        pid, pmask = pad_rows(p_ids, self._pad_id)
        qid, qmask = pad_rows(q_rows, self._pad_id)
        return Encoded(input_ids=pid, attention_mask=pmask, extra={"query_ids": qid, "query_mask": qmask})

    @property
    def lower_layers(self) -> int:
        """Layers the passage's lower states have been through (the split point); 0 when
        this model keeps no states."""
        return self._lower_layers if self.states_key is not None else 0

    def passage_rows(self, passages: list[str]) -> list[list[int]]:
        """The token rows a rerank's lower layers read for ``passages`` (prefix, cap, specials)."""
        return self._passage_rows(passages)

    def lower_states(self, rows: list[list[int]]) -> list[np.ndarray]:
        """The lower graph's states of token rows, one call per row (``_lower_states``)."""
        return self._lower_states(rows)

    def encode_states(self, states: np.ndarray) -> bytes:
        """[tokens, hidden] states -> what this model stores under ``states_key``: the states
        (joint scoring), or the passage's tower vector computed from them (towers)."""
        if self.scoring == SCORING_TOWERS:
            return self._codec.encode(self._tower_vectors([states])[0])
        return self._codec.encode(states)

    def _tower_vectors(self, states: list[np.ndarray]) -> list[np.ndarray]:
        """The tower on each row's [tokens, hidden] states -> a [1, hidden] vector each, one
        call per row, as ``_lower_states`` (a vector depends on its own text alone)."""

        def run(i: int) -> np.ndarray:
            x, mask = pad_states([states[i]], states[i].shape[1])
            return np.asarray(self._tower.run(None, {"states": x, "attention_mask": mask})[0], dtype=np.float32)

        return self._each_alone([len(x) for x in states], run)

    def _blobs(self, rows: list[list[int]]) -> list[bytes]:
        """What this model stores for passage token rows, encoded: each row's states, or its
        tower vector (towers)."""
        computed = self._lower_states(rows)
        if self.scoring == SCORING_TOWERS:
            computed = self._tower_vectors(computed)
        return [self._codec.encode(x) for x in computed]

    def _passage_rows(self, passages: list[str]) -> list[list[int]]:
        encoded = self._tokenizer.encode_batch(passages, add_special_tokens=False)
        return [self._assemble(e.ids, self._passage_prefix, self._passage_max) for e in encoded]

    def _lower_states(self, rows: list[list[int]]) -> list[np.ndarray]:
        """The lower layers on token rows -> one [tokens, hidden] float32 array per row, each
        row a call of its own: no padding, and (the int8 graph takes its activation scales
        over a whole call) a passage's states depend on its text alone, never on the rows
        it happened to be computed with. So states computed at ingest, computed by a rerank
        and written back, or computed again are the same bytes, and what a rerank reads
        does not depend on which queries ran before it. Costs nothing measurable against
        groups of 2 (README "Cached passage states")."""
        def run(i: int) -> np.ndarray:
            ids, mask = pad_rows([rows[i]], self._pad_id)
            return np.asarray(self._lower.run(None, {"input_ids": ids, "attention_mask": mask})[0][0], dtype=np.float32)

        return self._each_alone([len(r) for r in rows], run)

    def _each_alone(self, lengths: list[int], run: Callable[[int], np.ndarray]) -> list[np.ndarray]:
        """``run(i)`` for every row, a call of its own, on the fan-out pool when there is one
        (length order, as ``_by_length``): results by row."""
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(lengths)
        for group, result in self._by_length(lengths, lambda g: run(g[0]), rows=1):
            out[group[0]] = result
        return out

    def _by_length(self, lengths: list[int], fn: Callable[[list[int]], T],
                   rows: int | None = None) -> list[tuple[list[int], T]]:
        """``fn`` on each length group of the rows (``_length_groups``), on the fan-out pool
        when there is one: (group, its result) pairs."""
        groups = _length_groups(lengths, rows or _GROUP_ROWS)
        if self._fanout is None or len(groups) < 2:
            return [(g, fn(g)) for g in groups]
        return list(zip(groups, self._fanout.map(fn, groups)))

    def passage_states(self, passages: list[str]) -> list[bytes]:
        if self.states_key is None:
            return super().passage_states(passages)
        if not passages:
            return []
        return self._blobs(self._passage_rows(passages))

    def tokenize_with_states(self, pairs: list[tuple[str, str]], states: Sequence[bytes | None]) -> Encoded:
        if self.states_key is None:
            return self.tokenize(pairs)  # no two-graph layout: the one graph
        # With the two graphs, even a rerank with nothing stored takes them: length-sorted
        # groups pad far less than one call over every pair, and run in parallel (README
        # "Cached passage states"; the logits match the one graph's within its own int8 noise).
        distinct = list(dict.fromkeys(q for q, _ in pairs))
        q_rows = [self._assemble(e.ids, self._query_prefix, self.max_query_tokens)
                  for e in self._tokenizer.encode_batch(distinct, add_special_tokens=False)]
        present = [(i, blob) for i, blob in enumerate(states) if blob is not None]
        try:
            stored = dict(zip((i for i, _ in present), self._codec.decode_many([blob for _, blob in present])))
        except ValueError:  # a blob this model cannot read: compute that passage's states
            stored = {}
            for i, blob in present:
                try:
                    stored[i] = self._codec.decode(blob)
                except ValueError:
                    pass
        missing = [i for i in range(len(pairs)) if i not in stored]
        n = len(pairs)
        return Encoded(input_ids=np.zeros((n, 0), np.int64), attention_mask=np.zeros((n, 0), np.int64), extra={
            "query_rows": q_rows,
            "query_of": np.array([distinct.index(q) for q, _ in pairs], np.int64),
            "stored": stored,
            "missing": missing,
            "missing_rows": self._passage_rows([pairs[i][1] for i in missing]) if missing else [],
        })

    def _stored_or_computed(self, ex: dict[str, Any]) -> dict[int, np.ndarray]:
        """Each pair's passage, by row: its stored form decoded, or computed now through the
        same codec (so a head that mixes stored and computed ones ranks them alike: a
        projection shifts logits), the computed blobs kept in ``ex`` for a write-back."""
        per_row: dict[int, np.ndarray] = dict(ex["stored"])
        if ex["missing"]:
            blobs = self._blobs(ex["missing_rows"])
            per_row.update(zip(ex["missing"], self._codec.decode_many(blobs)))
            ex["computed_states"] = dict(zip(ex["missing"], blobs))
        return per_row

    def _infer_with_states(self, encoded: Encoded) -> FloatArray:
        if self.scoring == SCORING_TOWERS:
            return self._infer_towers(encoded)
        ex = encoded.extra
        n = encoded.batch_size
        q_states = self._lower_states(ex["query_rows"])
        per_row = self._stored_or_computed(ex)
        hidden = q_states[0].shape[1]

        qx, qmask = pad_states(q_states, hidden)
        of = ex["query_of"]
        logits = np.zeros(n, np.float32)

        def run(group: list[int]) -> np.ndarray:
            px, pmask = pad_states([per_row[i] for i in group], hidden)
            rows = of[group]
            out = self._joint.run(None, {"query_states": qx[rows], "query_mask": qmask[rows],
                                         "passage_states": px, "passage_mask": pmask})[0]
            return np.asarray(out, dtype=np.float32).reshape(len(group))

        for group, out in self._by_length([per_row[i].shape[0] for i in range(n)], run):
            logits[group] = out
        return logits

    def _infer_towers(self, encoded: Encoded) -> FloatArray:
        """Each distinct query's tower once, the passages' vectors stored or computed (through
        the codec, as stored ones are), then the head on each pair's two vectors."""
        ex = encoded.extra
        q_vectors = np.concatenate(self._tower_vectors(self._lower_states(ex["query_rows"])))
        per_row = self._stored_or_computed(ex)
        p_vectors = np.concatenate([per_row[i] for i in range(encoded.batch_size)])
        return tower_logits(q_vectors[ex["query_of"]], p_vectors, self._head_w, self._head_b)

    def tokenize(self, pairs: list[tuple[str, str]]) -> Encoded:
        if self.split:
            return self._split_tokenize(pairs)
        tok = self._tokenizer
        queries = tok.encode_batch([q for q, _ in pairs], add_special_tokens=False)
        passages = tok.encode_batch([p for _, p in pairs], add_special_tokens=False)
        encodings = []
        for q, p in zip(queries, passages):
            q.truncate(self.max_query_tokens)
            p.truncate(self._pair_budget - len(q.ids))
            encodings.append(tok.post_process(q, p, add_special_tokens=True))
        ids, mask, types = pad_batch(encodings, self._pad_id)
        return Encoded(input_ids=ids, attention_mask=mask, token_type_ids=types if self._token_types else None)

    def infer(self, encoded: Encoded) -> FloatArray:
        if encoded.batch_size == 0:
            return np.zeros((0,), dtype=np.float32)
        if "stored" in encoded.extra:
            return self._infer_with_states(encoded)
        if self.split:
            feeds = {"query_ids": encoded.extra["query_ids"], "query_mask": encoded.extra["query_mask"],
                     "passage_ids": encoded.input_ids, "passage_mask": encoded.attention_mask}
            out = _run_first_output(self._one_graph(), feeds)
            return np.asarray(out, dtype=np.float32).reshape(encoded.batch_size)
        feeds = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask}
        if encoded.token_type_ids is not None:
            feeds["token_type_ids"] = encoded.token_type_ids
        out = _run_first_output(self._one_graph(), feeds)
        return np.asarray(out, dtype=np.float32).reshape(encoded.batch_size)


def _run_first_output(session: Any, feeds: dict[str, Any]) -> Any:
    """The graph's first output (the logits), and only that one computed."""
    return session.run([session.get_outputs()[0].name], feeds)[0]


# Rows per length-sorted group: padding waste against per-call overhead. Measured on 20
# InsuranceQA pairs (joint layers, 1 thread, p50): rows of 1 / 2 / 4 / 8 / 20 took
# 76 / 75 / 90 / 116 / 244 ms (zh) and 93 / 101 / 112 / - / - ms (en): padding costs far
# more than a call (README "Cached passage states").
_GROUP_ROWS = 2


def _length_groups(lengths: list[int], rows: int = _GROUP_ROWS) -> list[list[int]]:
    """Row indices sorted by length, cut into groups of ``rows``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[k : k + rows] for k in range(0, len(order), rows)]


def load_cross_encoder(model_dir: Path, threads: int = 1, max_length: int | None = None,
                       compact_states: bool = False, parallel: int = 1, passage_tokens: int = 0,
                       scoring: str = "auto") -> OnnxCrossEncoder:
    return OnnxCrossEncoder(model_dir, threads=threads, max_length=max_length, compact_states=compact_states,
                            parallel=parallel, passage_tokens=passage_tokens, scoring=scoring)
