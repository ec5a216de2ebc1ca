"""Records -> tokens with a loss mask: each record format's text and counted spans
(document_pieces), encoded in bounded pieces (encode_masked), with BOS/EOS (tokenize_chunk)."""
from __future__ import annotations

import re

import numpy as np

from ..errors import LoracError
from .formats import normalize_record
from .read import CONTINUED

MAX_PIECE = 1 << 16     # chars: a longer document is tokenized in pieces of at most this
ENCODE_CHARS = 1 << 18  # chars per encode_batch call at the most (pieces of one chunk)


def document_pieces(record, tokenizer, where):
    """record -> (text, [(start, end)] char spans that count in the loss, eos, bos)."""
    record = normalize_record(record, bool(tokenizer.chat_template), where)  # alpaca, sharegpt
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages):
            raise LoracError(f"{where}: \"messages\" must be a list of {{role, content}} objects")
        if not any(m["role"] == "assistant" for m in messages):
            raise LoracError(f"{where}: conversation has no assistant turn to learn from")
        try:
            text, spans = tokenizer.chat_spans(messages)
        except LoracError as e:
            raise LoracError(f"{where}: {e}") from None
        return text, spans, True, False  # the template writes BOS itself if the model wants it
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise LoracError(f"{where}: \"prompt\" and \"completion\" must both be strings")
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True, True
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise LoracError(f"{where}: \"text\" must be a string")
        return text, [(0, len(text))], record.get("eos", True), record.get("bos", True)
    raise LoracError(f"{where}: record has none of the keys text, prompt/completion, messages, "
                     "instruction/output (alpaca), conversations (sharegpt)")


def tokenize_chunk(chunk, tokenizer, vocab_size, path):
    """[(lineno, record)] -> [(ids int32, mask uint8, new_doc)], one per record; new_doc is
    False for the second and later pieces of a long plain-text paragraph (one document)."""
    pieces = [valid_text(document_pieces(r, tokenizer, f"{path}:{n}"), f"{path}:{n}") for n, r in chunk]
    out = []
    for (lineno, record), (text, spans, eos, bos), (ids, mask) in zip(chunk, pieces, encode_masked(tokenizer, pieces)):
        if bos and tokenizer.add_bos:
            ids = np.concatenate([np.asarray([tokenizer.bos_id], np.int32), ids])
            mask = np.concatenate([np.zeros(1, np.uint8), mask])
        # a chat rendering ending "<eos>\n" already separates: no second EOS
        if eos and tokenizer.eos_id not in ids[-2:].tolist():
            ids = np.concatenate([ids, np.asarray([tokenizer.eos_id], np.int32)])
            mask = np.concatenate([mask, np.ones(1, np.uint8)])
        if len(ids) and ids.max() >= vocab_size:
            raise LoracError(f"{path}:{lineno}: token id {int(ids.max())} >= the model's vocab size "
                             f"{vocab_size} (tokenizer and model do not match)")
        out.append((ids, mask, not record.get(CONTINUED, False)))
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(piece, where):
    """A document's text must be Unicode the tokenizer can encode: JSON lets an escape name half
    of a UTF-16 pair ("\\ud800") alone, which no UTF-8 holds and the tokenizer refuses with a
    TypeError."""
    m = _SURROGATE.search(piece[0])
    if m:
        raise LoracError(f"{where}: a lone UTF-16 surrogate {ascii(m.group())[1:-1]} at character {m.start()} of the "
                         "text, which is not valid Unicode (a \\uD800-\\uDFFF escape without its pair?)")
    return piece


def encode_masked(tokenizer, pieces):
    """[(text, spans, ...)] -> [(ids int32, mask uint8)]: a token counts when any of its
    characters lies in a counted span (with a prompt ending in a blank, "Q: ", the first answer
    token carries that blank, "Ġanswer", and is the answer's first word, so it counts).

    A text over MAX_PIECE chars is encoded in pieces cut at a line end or before a blank
    (cut_points), at most ENCODE_CHARS chars per encode_batch call, and each piece becomes
    ids and mask at once: the tokenizer's memory grows far faster than one long string (a 5 MB
    line took 2 GB whole). Tokens at a cut may differ from those of a whole encode."""
    jobs = [(d, a, b) for d, p in enumerate(pieces) for a, b in cut_points(p[0])]
    parts = [[] for _ in pieces]
    group, size = [], 0
    for k, job in enumerate(jobs):
        group.append(job)
        size += job[2] - job[1]
        if size < ENCODE_CHARS and k < len(jobs) - 1:
            continue
        for (d, a, b), enc in zip(group, tokenizer.encode_batch([pieces[d][0][a:b] for d, a, b in group])):
            text, spans = pieces[d][0], pieces[d][1]
            ids = np.asarray(enc.ids, np.int32)
            if spans == [(0, len(text))]:  # everything counts: offsets not needed
                mask = np.ones(len(ids), np.uint8)
            else:
                offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2) + a
                counted = np.zeros(len(ids), dtype=bool)
                for s, e in spans:
                    counted |= (offsets[:, 1] > s) & (offsets[:, 0] < e)
                mask = counted.astype(np.uint8)
            parts[d].append((ids, mask))
        group, size = [], 0
    return [(np.concatenate([i for i, _ in p]), np.concatenate([m for _, m in p])) for p in parts]


def cut_points(text):
    """[(start, end)] pieces of at most MAX_PIECE chars covering `text`; each cut falls after
    the last newline, else before the last blank, of the piece's second half."""
    out, a, n = [], 0, len(text)
    while n - a > MAX_PIECE:
        b = a + MAX_PIECE
        nl = text.rfind("\n", a + MAX_PIECE // 2, b)
        sp = text.rfind(" ", a + MAX_PIECE // 2, b)
        b = nl + 1 if nl >= 0 else (sp if sp > a else b)
        out.append((a, b))
        a = b
    out.append((a, n))
    return out
