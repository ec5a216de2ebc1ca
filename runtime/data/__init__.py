"""Training data: documents -> tokens with a loss mask -> packed [batch, seq] rows.

Formats (picked per file by its suffix, per record by its keys):
    plain text (.txt, anything not .jsonl/.json): paragraphs split at blank lines
    JSONL {"text": ...}                        every token counts
    JSONL {"prompt": ..., "completion": ...}   only completion tokens count
    JSONL {"messages": [{"role", "content"}]}  rendered with the chat template; only the
                                               assistant turns count
    alpaca and sharegpt records (runtime/data/formats.py), HF datasets and JSON arrays (runtime/data/sources.py)
Labels follow HF: the same ids as input_ids (the graph shifts them), -100 where a token
does not count. Every document ends with EOS (a chat rendering that already closes with
it gets none added), so packed rows carry EOS separators; the model learns to stop.

Streaming: files are read a line at a time and tokenized in chunks of documents; the
tokens go to flat files (ids int32, mask uint8, document starts int64) per split in a
cache folder and are read back memory-mapped, so memory stays bounded for any corpus size.
A row is the slice [r*S, (r+1)*S) of the split's token stream; the last partial row is
padded with EOS whose labels are -100.

Packing (docs/DATA.md): "plain" rows are just that; "isolated" rows also carry
position_ids, each document's tokens (its part in the row) numbered from 0, so the graphs
keep attention inside documents, and the label of each document's first token is -100
(predicting it from the previous document's tokens is what isolation forbids), as
transformers' DataCollatorWithFlattening does. The padding is a document of its own.

The eval split is deterministic without knowing the corpus size: document i (0-based)
goes to eval when floor((i+1)*f) > floor(i*f), i.e. evenly every 1/f documents. Or a
separate eval file is given.

Order: each epoch visits the train rows in the permutation drawn from
numpy's default_rng([seed, epoch]); the iterator's whole state is {epoch, index, seed},
so a checkpoint resumes the exact batch sequence.
"""

import glob
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import weakref

import numpy as np

from .formats import normalize_record
from ..errors import LoracError

IGNORE = -100           # HF's label for "no loss here"
PACKINGS = ("plain", "isolated")  # how documents share a row (module doc)
CONTINUED = "\0continued"  # a plain-text record key: this piece continues the previous record's document
CHUNK_DOCS = 256        # documents tokenized per encode_batch call
MAX_PARAGRAPH = 1 << 16  # chars: a plain-text paragraph longer than this is cut at a line end
MAX_PIECE = 1 << 16     # chars: a longer document is tokenized in pieces of at most this
ENCODE_CHARS = 1 << 18  # chars per encode_batch call at the most (pieces of one chunk)
MAX_LINE = 1 << 24      # chars: a longer JSONL line (one record) is refused, never read whole
TEMP_PREFIX = "lorac-data-"
UNLOCKED_AGE = 86400    # s: a temp folder without a lock file older than this is removed


# ---------------------------------------------------------------- reading

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
    with open(path, encoding="utf-8", errors="strict") as f:
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
            if not isinstance(record, dict):
                raise LoracError(f"{path}:{lineno}: a JSON object is expected, got {type(record).__name__}")
            yield lineno, record


def _read_text(path):
    with open(path, encoding="utf-8", errors="strict") as f:
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


# ---------------------------------------------------------------- tokenizing

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
    pieces = [document_pieces(r, tokenizer, f"{path}:{n}") for n, r in chunk]
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


# ---------------------------------------------------------------- token store

class TokenStore:
    """A split's token stream in two flat files (ids int32, mask uint8), appended while
    tokenizing (buffered: one write per FLUSH_TOKENS), memory-mapped once `close()`d."""

    FLUSH_TOKENS = 1 << 17

    def __init__(self, folder, name):
        self.ids_path = os.path.join(folder, f"{name}.ids.i32")
        self.mask_path = os.path.join(folder, f"{name}.mask.u8")
        self.starts_path = os.path.join(folder, f"{name}.starts.i64")  # offset of each document's first token
        self._ids = open(self.ids_path, "wb")
        self._mask = open(self.mask_path, "wb")
        self._starts = open(self.starts_path, "wb")
        self.n_tokens = self.n_counted = self.n_docs = 0
        self.ids = self.mask = self.starts = None
        self._buf, self._buffered, self._buf_starts = [], 0, []
        self._sha_ids, self._sha_mask, self._sha_starts = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()

    def append(self, ids, mask, new_doc=True):
        """A document's tokens, or with new_doc=False the next piece of the last one."""
        assert ids.dtype == np.int32 and mask.dtype == np.uint8, "the files hold int32 ids, uint8 mask"
        if new_doc or self.n_docs == 0:
            self._buf_starts.append(self.n_tokens)
            self.n_docs += 1
        self._buf.append((ids, mask))
        self._buffered += len(ids)
        self.n_tokens += len(ids)
        self.n_counted += int(mask.sum())
        if self._buffered >= self.FLUSH_TOKENS:
            self._flush()

    def _flush(self):
        if self._buf:
            ids, mask = np.concatenate([i for i, _ in self._buf]), np.concatenate([m for _, m in self._buf])
            starts = np.asarray(self._buf_starts, np.int64)
            ids.tofile(self._ids)
            mask.tofile(self._mask)
            starts.tofile(self._starts)
            self._sha_ids.update(ids)  # the arrays' own buffers: no copies
            self._sha_mask.update(mask)
            self._sha_starts.update(starts)
        self._buf, self._buffered, self._buf_starts = [], 0, []

    def close(self):
        if self._ids.closed:
            return
        self._flush()
        for f in (self._ids, self._mask, self._starts):
            f.close()
        if self.n_tokens:
            self.ids = np.memmap(self.ids_path, dtype=np.int32, mode="r")
            self.mask = np.memmap(self.mask_path, dtype=np.uint8, mode="r")
            self.starts = np.memmap(self.starts_path, dtype=np.int64, mode="r")
        else:
            self.ids, self.mask, self.starts = np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64)

    def n_rows(self, seq):
        return math.ceil(self.n_tokens / seq)

    @property
    def digest(self) -> str:
        """sha256 of the stream (its ids, its mask and where its documents start), known once closed."""
        return hashlib.sha256(self._sha_ids.digest() + self._sha_mask.digest() + self._sha_starts.digest()).hexdigest()

    def answer_rows(self, seq, isolated=False):
        """Numbers of the rows with at least one label the loss sees: the graph predicts token
        t+1 from t, so a counted token in a row's first position is never a target (nor, with
        isolated documents, one at a document's start). Read in blocks of rows from the
        memory-mapped mask."""
        n_rows, found = self.n_rows(seq), []
        block = max(1, (1 << 20) // seq)
        for a in range(0, n_rows, block):
            b = min(n_rows, a + block)
            rows = np.zeros((b - a) * seq, np.uint8)
            part = np.asarray(self.mask[a * seq:b * seq])
            rows[:len(part)] = part  # the last row's padding counts nothing
            rows = rows.reshape(b - a, seq)
            if isolated:
                rows[self.positions(np.arange(a, b), seq) == 0] = 0
            found.append(a + np.flatnonzero(rows[:, 1:].max(axis=1)))  # max: no bool copy of the block
        return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)

    def positions(self, index, seq):
        """Rows `index` -> position ids, int64 [len(index), seq]: each token's offset from the
        start of its document or of the row, whichever is later (a row that starts inside a
        document sees only that part of it); the last row's padding is a document of its own."""
        index = np.asarray(index, np.int64)
        if len(index) == 0:
            return np.zeros((0, seq), np.int64)
        first = np.zeros((len(index), seq), bool)
        first[:, 0] = True
        for k, r in enumerate(index.tolist()):
            a, b = r * seq, (r + 1) * seq
            lo, hi = np.searchsorted(self.starts, [a, b])  # the documents starting in [a, b)
            first[k, np.asarray(self.starts[lo:hi]) - a] = True
            if a < self.n_tokens < b:
                first[k, self.n_tokens - a] = True
        col = np.arange(seq, dtype=np.int64)
        return col - np.maximum.accumulate(np.where(first, col, 0), axis=1)

    def rows(self, index, seq, pad_id):
        """Rows `index` (array of row numbers) -> (input_ids, labels), int64 [len(index), seq]."""
        ids = np.full((len(index), seq), pad_id, dtype=np.int64)
        labels = np.full((len(index), seq), IGNORE, dtype=np.int64)
        for k, r in enumerate(index):
            a, b = int(r) * seq, min((int(r) + 1) * seq, self.n_tokens)
            ids[k, :b - a] = self.ids[a:b]
            labels[k, :b - a] = np.where(self.mask[a:b] > 0, self.ids[a:b], IGNORE)
        return ids, labels


# ---------------------------------------------------------------- the dataset

class PackedData:
    """A tokenized, packed dataset: `.train` and `.eval` TokenStores, `.seq`, `.pad_id`.

    Rows in which no label counts (a long prompt filling a whole row, say) would make a step
    that learns nothing and an eval loss of 0: they are left out of both (`train_rows`,
    `eval_rows`: the row numbers used) and counted in describe()."""

    def __init__(self, train, eval_, seq, pad_id, folder, owns_folder, lock=None, packing="plain"):
        if packing not in PACKINGS:
            raise LoracError(f"--packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self.train, self.eval, self.seq, self.pad_id = train, eval_, seq, pad_id
        self.packing = packing
        self.folder = folder
        if owns_folder:  # a temporary cache goes when the dataset does (and its lock with it)
            self._cleanup = weakref.finalize(self, _remove_temp, folder, lock)
        isolated = packing == "isolated"
        self.train_rows, self.eval_rows = train.answer_rows(seq, isolated), eval_.answer_rows(seq, isolated)

    def batch(self, store, index):
        """Rows `index` of `store` as a batch: {"input_ids", "labels"} int64 [len(index), seq],
        and with isolated packing "position_ids", each document's first label -100."""
        ids, labels = store.rows(index, self.seq, self.pad_id)
        if self.packing != "isolated":
            return {"input_ids": ids, "labels": labels}
        positions = store.positions(index, self.seq)
        labels[positions == 0] = IGNORE
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    @property
    def n_train_rows(self):
        return len(self.train_rows)

    @property
    def digest(self) -> str:
        """Identity of the training stream (what --resume must find again)."""
        return self.train.digest

    def batches(self, batch, seed=0, state=None):
        """An endless, resumable iterator of training batches (see BatchIterator)."""
        return BatchIterator(self, batch, seed, state)

    def eval_batches(self, batch):
        """The eval rows in order, in batches of `batch`; the last is padded with rows that
        count nothing (labels all -100)."""
        n = len(self.eval_rows)
        for start in range(0, n, batch):
            index = self.eval_rows[start:start + batch]
            b = self.batch(self.eval, index)
            if len(index) < batch:
                fill = batch - len(index)
                filler = {"input_ids": np.full((fill, self.seq), self.pad_id, np.int64),
                          "labels": np.full((fill, self.seq), IGNORE, np.int64),
                          "position_ids": np.broadcast_to(np.arange(self.seq, dtype=np.int64), (fill, self.seq))}
                b = {k: np.concatenate([v, filler[k]]) for k, v in b.items()}
            yield b

    def describe(self):
        return {"train_docs": self.train.n_docs, "train_tokens": self.train.n_tokens,
                "train_counted": self.train.n_counted, "train_rows": self.n_train_rows,
                "train_rows_without_answer": self.train.n_rows(self.seq) - self.n_train_rows,
                "eval_docs": self.eval.n_docs, "eval_tokens": self.eval.n_tokens,
                "eval_counted": self.eval.n_counted, "eval_rows": len(self.eval_rows),
                "eval_rows_without_answer": self.eval.n_rows(self.seq) - len(self.eval_rows),
                "packing": self.packing}


class BatchIterator:
    """Yields {"input_ids", "labels"} (and "position_ids" with isolated packing) int64
    [batch, seq] forever, epoch after epoch.

    Position k of the endless stream is row perm_e[i] with e = epoch, i = index; a batch
    that runs past an epoch's end continues with the next epoch's permutation. `state()`
    is a small JSON-able dict; passing it back resumes the exact sequence.
    """

    def __init__(self, data, batch, seed=0, state=None):
        self.data, self.batch = data, int(batch)
        self.n = data.n_train_rows
        state = state or {"epoch": 0, "index": 0, "seed": int(seed)}
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        if self.index > self.n:
            raise LoracError(f"data position {self.index} is past this dataset's {self.n} rows "
                             "(checkpoint from another dataset or sequence length?)")
        self._perm_epoch, self._perm = None, None

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def _permutation(self):
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self):
        return self

    def __next__(self):
        rows = []
        while len(rows) < self.batch:
            take = self._permutation()[self.index:self.index + self.batch - len(rows)]
            rows.extend(take.tolist())
            self.index += len(take)
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return self.data.batch(self.data.train, self.data.train_rows[rows])


def is_eval_doc(i, fraction):
    """Document i belongs to the eval split: evenly one in every 1/fraction documents."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def load_dataset(path, tokenizer, seq, vocab_size, eval_fraction=0.05, eval_path=None,
                 cache_dir=None, chunk_docs=CHUNK_DOCS, packing="plain") -> PackedData:
    """Tokenize and pack a data file (streaming) into a PackedData.

    With eval_path the eval split is that file; else every 1/eval_fraction-th document
    of `path` (and at least one, where the file has two or more documents). `packing`:
    "plain" or "isolated" (module doc).
    """
    if seq < 2:
        raise LoracError(f"sequence length must be at least 2, got {seq}")
    owns = cache_dir is None
    folder, lock = _temp_folder() if owns else (cache_dir, None)
    os.makedirs(folder, exist_ok=True)
    train, eval_ = TokenStore(folder, "train"), TokenStore(folder, "eval")
    try:
        _fill(path, eval_path, eval_fraction, tokenizer, vocab_size, chunk_docs, train, eval_)
        data = PackedData(train, eval_, int(seq), tokenizer.eos_id, folder, owns, lock, packing)
        _check_rows(data, path, eval_path if eval_path is not None else path if eval_fraction > 0 else None)
    except BaseException:
        train.close()
        eval_.close()
        if owns:
            _remove_temp(folder, lock)
        raise
    return data


def _check_rows(data, path, eval_path):
    """Refuse a split none of whose rows has a label the loss sees (module doc of PackedData)."""
    why = (f"rows of {data.seq} tokens in which no answer token follows the row's first position "
           "(prompts longer than the sequence length?); raise --seq or shorten the prompts")
    if data.n_train_rows == 0:
        raise LoracError(f"{path}: all {data.train.n_rows(data.seq)} training rows were dropped: {why}")
    if eval_path is not None and data.eval.n_tokens and len(data.eval_rows) == 0:
        raise LoracError(f"{eval_path}: all {data.eval.n_rows(data.seq)} eval rows were dropped: {why}")


# ---------------------------------------------------------------- temporary folders

def _temp_folder():
    """(folder, lock): a fresh lorac-data-* folder in the temp dir, locked while in use. Folders
    whose lock is free are removed first: their process died (kill -9, a crash). A new folder
    is locked before it appears under that name, so a live one is never taken for dead."""
    from lorac.core import locks
    for old in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(TEMP_PREFIX) + "*")):
        try:
            if not os.path.exists(os.path.join(old, ".lock")):  # made by a lorac without these locks:
                if time.time() - os.path.getmtime(old) > UNLOCKED_AGE:  # surely dead after a day
                    shutil.rmtree(old, ignore_errors=True)
                continue
            lock = locks.acquire(os.path.join(old, ".lock"), wait=False)
        except OSError:  # another user's folder, or gone meanwhile
            continue
        if lock is not None:
            _remove_temp(old, lock)
    staging = tempfile.mkdtemp(prefix="." + TEMP_PREFIX)
    lock = locks.acquire(os.path.join(staging, ".lock"))
    folder = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
    os.rename(staging, folder)
    return folder, lock


def _remove_temp(folder, lock):
    shutil.rmtree(folder, ignore_errors=True)
    if lock is not None:
        lock.release()


def _fill(path, eval_path, eval_fraction, tokenizer, vocab_size, chunk_docs, train, eval_):
    split = eval_path is None and eval_fraction > 0
    pending = None  # the latest train document, held back until we know eval is not empty
    last = None  # the split the previous piece went to: a continued piece elsewhere starts a document there
    for doc_index, (ids, mask, new_doc) in _tokenized_docs(path, tokenizer, vocab_size, chunk_docs):
        to_eval = split and is_eval_doc(doc_index, eval_fraction)
        tokens = (ids, mask, new_doc or last != to_eval)
        last = to_eval
        if to_eval:
            eval_.append(*tokens)
            continue
        if pending is not None:
            train.append(*pending)
        pending = tokens
    if train.n_docs + eval_.n_docs + (pending is not None) == 0:
        raise LoracError(f"{path}: dataset is empty (no documents)")
    if pending is not None:
        # a corpus too short for even one eval document gives its last one to eval
        if split and eval_.n_docs == 0 and train.n_docs > 0:
            eval_.append(*pending)
        else:
            train.append(*pending)
    if eval_path is not None:
        for _, tokens in _tokenized_docs(eval_path, tokenizer, vocab_size, chunk_docs):
            eval_.append(*tokens)
    train.close()
    eval_.close()
    if train.n_counted == 0:
        raise LoracError(f"{path}: no training token counts in the loss (empty answers, or too few documents)")
    if (split or eval_path is not None) and eval_.n_counted == 0:
        raise LoracError(f"{eval_path or path}: the eval split has no token that counts in the loss")


def _tokenized_docs(path, tokenizer, vocab_size, chunk_docs):
    """Yield (document index, (ids, mask)) over a file, tokenizing chunk_docs at a time."""
    chunk, index = [], 0
    for item in read_records(path):
        chunk.append(item)
        if len(chunk) >= chunk_docs:
            for tokens in tokenize_chunk(chunk, tokenizer, vocab_size, path):
                yield index, tokens
                index += 1
            chunk = []
    if chunk:
        for tokens in tokenize_chunk(chunk, tokenizer, vocab_size, path):
            yield index, tokens
            index += 1
