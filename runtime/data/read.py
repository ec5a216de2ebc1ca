"""Reading a data file's records lazily: JSONL objects, plain-text paragraphs (cut when
longer than MAX_PARAGRAPH), or an HF dataset / JSON array (sources.py)."""
from __future__ import annotations

import json
import os

from ..errors import LoracError
from ..files import open_regular

CONTINUED = "\0continued"  # a plain-text record key: this piece continues the previous record's document
MAX_PARAGRAPH = 1 << 16  # chars: a plain-text paragraph longer than this is cut at a line end
MAX_LINE = 1 << 24      # chars: a longer JSONL line (one record) is refused, never read whole


def read_records(path):
    """Yield (line number, record dict) from a data file, lazily.

    Plain text yields {"text": paragraph, "eos": bool, "bos": bool}: a paragraph longer
    than MAX_PARAGRAPH is cut at a line end into pieces that stay one document in the
    stream (BOS only before the first, EOS only after the last, CONTINUED on the others).
    """
    path = os.fspath(path)
    from .sources import dataset_records, is_dataset_source
    if is_dataset_source(path):  # HF datasets (hub id, parquet, arrow, folder), a JSON array
        yield from dataset_records(path)
        return
    if not os.path.exists(path):
        raise LoracError(f"data file not found: {path}")
    if os.path.isdir(path):
        raise LoracError(f"{path}: is a directory, not a data file")
    if path.endswith((".jsonl", ".json")):
        yield from _read_jsonl(path)
    else:
        yield from _read_text(path)


def _read_jsonl(path):
    with open_regular(path, what="data file", encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(_lines(f, path, MAX_LINE + 1), 1):
            if len(line) > MAX_LINE:
                raise LoracError(f"{path}:{lineno}: line longer than {MAX_LINE >> 20} M characters; "
                                 "split the document into several records (or use a plain-text file)")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise LoracError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:  # [[[[... deeper than Python's stack
                raise LoracError(f"{path}:{lineno}: JSON nested too deeply") from None
            if not isinstance(record, dict):
                raise LoracError(f"{path}:{lineno}: a JSON object is expected, got {type(record).__name__}")
            yield lineno, record


def _read_text(path):
    with open_regular(path, what="data file", encoding="utf-8", errors="strict") as f:
        para, size, start, cont = [], 0, 1, False
        # read in parts of at most MAX_PARAGRAPH chars, so one endless line is cut like a paragraph;
        # a part cut from the middle of a line is never a blank line
        for lineno, line in enumerate(_lines(f, path, MAX_PARAGRAPH), 1):
            if not line.strip() and (line.endswith("\n") or not para):
                if para:
                    yield start, {"text": "".join(para).rstrip("\n"), "eos": True, "bos": not cont, CONTINUED: cont}
                para, size, cont = [], 0, False
                continue
            if not para:
                start = lineno
            para.append(line)
            size += len(line)
            if size >= MAX_PARAGRAPH:
                yield start, {"text": "".join(para), "eos": False, "bos": not cont, CONTINUED: cont}
                para, size, cont = [], 0, True
        if para:
            yield start, {"text": "".join(para).rstrip("\n"), "eos": True, "bos": not cont, CONTINUED: cont}


def _lines(f, path, limit):
    """The lines of text file f, each cut into parts of at most `limit` chars."""
    try:
        yield from iter(lambda: f.readline(limit), "")
    except UnicodeDecodeError as e:
        raise LoracError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a read block)") from None
