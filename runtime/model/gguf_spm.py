"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model == "llama"`: Llama 2,
Mistral 7B v0.1, ...) as a `tokenizers.Tokenizer`.

A GGUF file keeps SentencePiece's pieces, their scores and types, not the .model file.
SentencePiece's BPE encodes by repeatedly joining the adjacent pair whose joined piece has
the highest score (ties: leftmost), then spells pieces missing from the vocabulary as
byte tokens <0xXX>; a BPE whose merge list is every split of every piece into two pieces,
ranked by the joined piece's score, joins the same pairs in the same order. Text is
prepared as llama.cpp does: spaces become "▁" and, with `add_space_prefix`, one "▁" goes
in front of the text. Decoding reverses both and joins the bytes of byte tokens.
"""
from __future__ import annotations

from ..errors import LoracError

SPACE = "\u2581"  # "▁", SentencePiece's visible space
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spm_merges(tokens, scores, types) -> list[tuple[str, str]]:
    """Every (left, right) pair of normal pieces whose join is a normal piece, the pairs of
    higher-scoring joins first (ties by the joined piece's id, then by the split point)."""
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(info: dict):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens, scores = info["tokens"], info.get("scores")
    if not scores:
        raise LoracError("GGUF SentencePiece tokenizer has no scores (tokenizer.ggml.scores)")
    types = info.get("token_type") or [NORMAL] * len(tokens)
    unk = next((t for t, k in zip(tokens, types) if k == UNKNOWN), None)
    has_bytes = any(k == BYTE for k in types)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores, types),
                     unk_token=unk, fuse_unk=True, byte_fallback=has_bytes)
    tok = Tokenizer(bpe)
    prefix = bool(info.get("add_space_prefix", True))
    # llama.cpp puts the "▁" in front of every stretch of text (after each special token too),
    # whatever it starts with: a normalizer, applied per stretch, does the same
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else [])
                                          + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " ")] + ([decoders.ByteFallback()] if has_bytes else []) + [decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    if special:
        tok.add_special_tokens(special)
    return tok
