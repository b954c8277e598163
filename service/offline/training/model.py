"""A plain-torch BERT cross-encoder laid out exactly like ``builder.bert_graph`` writes it:
post-LN encoder, erf GELU, additive ``(1 - mask) * -10000`` attention mask, token type row 0
folded into the positions (no token type input), and the ``cls_logit`` head
(``hidden[:, 0] @ w + b``). ``to_bert_weights`` hands the weights back in the builder's
``[in, out]`` layout, so the ONNX export is the same graph the embedder uses.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]  # the train extra
import torch.nn.functional as F  # type: ignore[import-not-found, unused-ignore]  # the train extra
from torch import nn  # type: ignore[import-not-found, unused-ignore]  # the train extra

from service.offline.builder.q4bin import BertConfig, BertWeights, LayerWeights


class Layer(nn.Module):  # type: ignore[misc, unused-ignore]  # Any without the train extra
    def __init__(self, h: int, heads: int, ff: int, eps: float, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.ao = (nn.Linear(h, h) for _ in range(4))
        self.aln = nn.LayerNorm(h, eps=eps)
        self.fi = nn.Linear(h, ff)
        self.fo = nn.Linear(ff, h)
        self.oln = nn.LayerNorm(h, eps=eps)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, ext_mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, hd).transpose(1, 2)

        p = self.dropout if self.training else 0.0
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=ext_mask.to(q.dtype), dropout_p=p, scale=1.0 / math.sqrt(hd))
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        x = self.aln(F.dropout(self.ao(ctx), p, self.training) + x)
        inter = F.gelu(self.fi(x), approximate="none")
        out: torch.Tensor = self.oln(F.dropout(self.fo(inter), p, self.training) + x)
        return out


class CrossEncoder(nn.Module):  # type: ignore[misc, unused-ignore]  # Any without the train extra
    def __init__(self, config: BertConfig, dropout: float = 0.1) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.word = nn.Embedding(config.vocab_size, h)
        self.position = nn.Embedding(config.max_positions, h)
        self.token_type = nn.Embedding(config.type_vocab_size, h)
        self.emb_ln = nn.LayerNorm(h, eps=config.eps)
        self.layers = nn.ModuleList(Layer(h, config.heads, config.intermediate, config.eps, dropout) for _ in range(config.layers))
        self.head = nn.Linear(h, 1)
        self.dropout = dropout

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits [batch] for int64 ids/mask [batch, seq]."""
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device)
        x = self.word(ids) + self.position(pos)[None] + self.token_type.weight[0]
        x = F.dropout(self.emb_ln(x), self.dropout, self.training)
        ext = ((1.0 - mask[:, None, None, :].float()) * -10000.0)
        for layer in self.blocks():
            x = layer(x, ext)
        logits: torch.Tensor = self.head(x[:, 0]).squeeze(-1)
        return logits

    def blocks(self) -> list[Layer]:
        return [cast(Layer, m) for m in self.layers]

    # -- weights in and out ---------------------------------------------------------------

    @torch.no_grad()
    def load_bert(self, w: BertWeights) -> None:
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

        self.word.weight.copy_(t(w.word))
        self.position.weight.copy_(t(w.position))
        self.token_type.weight.copy_(t(w.token_type))
        self.emb_ln.weight.copy_(t(w.emb_ln_w))
        self.emb_ln.bias.copy_(t(w.emb_ln_b))
        for layer, lw in zip(self.blocks(), w.layers):
            load_layer(layer, lw)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Everything but the (frozen) word and token type tables."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("word.", "token_type."))}

    @torch.no_grad()
    def to_bert_weights(self, word: np.ndarray, token_type: np.ndarray) -> tuple[BertWeights, np.ndarray, np.ndarray]:
        """Builder-layout weights (with the given full word / type tables) + head w [h, 1], b [1]."""

        def n(x: torch.Tensor) -> np.ndarray:
            return x.detach().float().cpu().numpy()

        layers = []
        for L in self.blocks():
            layers.append(LayerWeights(
                np.ascontiguousarray(n(L.q.weight).T), n(L.q.bias), np.ascontiguousarray(n(L.k.weight).T), n(L.k.bias),
                np.ascontiguousarray(n(L.v.weight).T), n(L.v.bias), np.ascontiguousarray(n(L.ao.weight).T), n(L.ao.bias),
                n(L.aln.weight), n(L.aln.bias),
                np.ascontiguousarray(n(L.fi.weight).T), n(L.fi.bias), np.ascontiguousarray(n(L.fo.weight).T), n(L.fo.bias),
                n(L.oln.weight), n(L.oln.bias),
            ))
        weights = BertWeights(word=word, position=n(self.position.weight), token_type=token_type,
                              emb_ln_w=n(self.emb_ln.weight), emb_ln_b=n(self.emb_ln.bias), layers=layers)
        return weights, np.ascontiguousarray(n(self.head.weight).T), n(self.head.bias)


@torch.no_grad()
def load_layer(layer: Layer, lw: LayerWeights) -> None:
    """Copy one builder-layout layer (matrices ``[in, out]``) into a torch ``Layer``."""

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    for name, (wt, bs) in _linears(lw).items():
        lin = cast(nn.Linear, getattr(layer, name))
        lin.weight.copy_(t(wt).T)
        lin.bias.copy_(t(bs))
    layer.aln.weight.copy_(t(lw.aln_w))
    layer.aln.bias.copy_(t(lw.aln_b))
    layer.oln.weight.copy_(t(lw.oln_w))
    layer.oln.bias.copy_(t(lw.oln_b))


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One update of the split and embedder trainers: backward, clip at 1.0, step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, train_seconds: float) -> None:
    """What ``--resume`` reads back: weights, optimizer state, step and seconds trained."""
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "train_seconds": train_seconds}, path)


def _linears(lw: LayerWeights) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {"q": (lw.q_w, lw.q_b), "k": (lw.k_w, lw.k_b), "v": (lw.v_w, lw.v_b), "ao": (lw.ao_w, lw.ao_b),
            "fi": (lw.fi_w, lw.fi_b), "fo": (lw.fo_w, lw.fo_b)}


def build_model(config: BertConfig, weights: BertWeights, layers: int | None = None, dropout: float = 0.1,
                seed: int = 0) -> CrossEncoder:
    """A cross-encoder initialised from ``weights`` (first ``layers`` layers), head seeded."""
    n = layers or config.layers
    if n > config.layers:
        raise ValueError(f"backbone has {config.layers} layers, asked for {n}")
    cfg = BertConfig(config.hidden, n, config.heads, config.intermediate, config.vocab_size, config.max_positions,
                     config.type_vocab_size, config.eps)
    torch.manual_seed(seed)
    model = CrossEncoder(cfg, dropout=dropout)
    model.load_bert(BertWeights(weights.word, weights.position, weights.token_type, weights.emb_ln_w, weights.emb_ln_b,
                                weights.layers[:n]))
    with torch.no_grad():
        model.head.weight.normal_(0.0, 0.02)
        model.head.bias.zero_()
    model.word.weight.requires_grad_(False)
    model.token_type.weight.requires_grad_(False)
    return model
