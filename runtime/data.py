"""Training data: documents -> tokens with a loss mask -> packed [batch, seq] rows.

Formats (picked per file by its suffix, per record by its keys):
    plain text (.txt, anything not .jsonl/.json): paragraphs split at blank lines
    JSONL {"text": ...}                        every token counts
    JSONL {"prompt": ..., "completion": ...}   only completion tokens count
    JSONL {"messages": [{"role", "content"}]}  rendered with the chat template; only the
                                               assistant turns count
    alpaca and sharegpt records (data_formats.py), HF datasets and JSON arrays (data_sources.py)
Labels follow HF: the same ids as input_ids (the graph shifts them), -100 where a token
does not count. Every document ends with EOS (a chat rendering that already closes with
it gets none added), so packed rows carry EOS separators; the model learns to stop.

Streaming: files are read a line at a time and tokenized in chunks of documents; the
tokens go to two flat files (ids int32, mask uint8) per split in a cache folder and are
read back memory-mapped, so memory stays bounded for any corpus size. A row is the slice
[r*S, (r+1)*S) of the split's token stream; the last partial row is padded with EOS
whose labels are -100.

The eval split is deterministic without knowing the corpus size: document i (0-based)
goes to eval when floor((i+1)*f) > floor(i*f), i.e. evenly every 1/f documents. Or a
separate eval file is given.

Order: each epoch visits the train rows in the permutation drawn from
numpy's default_rng([seed, epoch]); the iterator's whole state is {epoch, index, seed},
so a checkpoint resumes the exact batch sequence.
"""

import json
import math
import os
import shutil
import tempfile
import weakref

import numpy as np

from .data_formats import normalize_record
from .errors import LoracError

IGNORE = -100           # HF's label for "no loss here"
CHUNK_DOCS = 256        # documents tokenized per encode_batch call
MAX_PARAGRAPH = 1 << 16  # chars: a plain-text paragraph longer than this is cut at a line end


# ---------------------------------------------------------------- reading

def read_records(path):
    """Yield (line number, record dict) from a data file, lazily.

    Plain text yields {"text": paragraph, "eos": bool, "bos": bool}: a paragraph longer
    than MAX_PARAGRAPH is cut at a line end into pieces that stay one document in the
    stream (BOS only before the first, EOS only after the last).
    """
    path = os.fspath(path)
    from .data_sources import dataset_records, is_dataset_source
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
        for lineno, line in enumerate(_lines(f, path), 1):
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
        for lineno, line in enumerate(_lines(f, path), 1):
            if not line.strip():
                if para:
                    yield start, {"text": "".join(para).rstrip("\n"), "eos": True, "bos": not cont}
                para, size, cont = [], 0, False
                continue
            if not para:
                start = lineno
            para.append(line)
            size += len(line)
            if size >= MAX_PARAGRAPH:
                yield start, {"text": "".join(para), "eos": False, "bos": not cont}
                para, size, cont = [], 0, True
        if para:
            yield start, {"text": "".join(para).rstrip("\n"), "eos": True, "bos": not cont}


def _lines(f, path):
    try:
        yield from f
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
        text, spans = tokenizer.chat_spans(messages)
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
    """[(lineno, record)] -> [(ids int32, mask uint8)], one per document.

    A token counts when any of its characters lies in a counted span: with a prompt that
    ends in a blank ("Q: ") the first answer token carries that blank ("Ġanswer"), and it
    is the answer's first word, so it must count.
    """
    pieces = [document_pieces(r, tokenizer, f"{path}:{n}") for n, r in chunk]
    encodings = tokenizer.encode_batch([p[0] for p in pieces])
    out = []
    for (lineno, _), (text, spans, eos, bos), enc in zip(chunk, pieces, encodings):
        ids = np.asarray(enc.ids, dtype=np.int64)
        if spans == [(0, len(text))]:  # plain text: everything counts, offsets not needed
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            counted = np.zeros(len(ids), dtype=bool)
            for s, e in spans:
                counted |= (offsets[:, 1] > s) & (offsets[:, 0] < e)
            mask = counted.astype(np.uint8)
        if bos and tokenizer.add_bos:
            ids = np.concatenate([np.asarray([tokenizer.bos_id], np.int64), ids])
            mask = np.concatenate([np.zeros(1, np.uint8), mask])
        # a chat rendering ending "<eos>\n" already separates: no second EOS
        if eos and tokenizer.eos_id not in ids[-2:].tolist():
            ids = np.concatenate([ids, np.asarray([tokenizer.eos_id], np.int64)])
            mask = np.concatenate([mask, np.ones(1, np.uint8)])
        if len(ids) and ids.max() >= vocab_size:
            raise LoracError(f"{path}:{lineno}: token id {int(ids.max())} >= the model's vocab size "
                             f"{vocab_size} (tokenizer and model do not match)")
        out.append((ids.astype(np.int32), mask))
    return out


# ---------------------------------------------------------------- token store

class TokenStore:
    """A split's token stream in two flat files (ids int32, mask uint8), appended while
    tokenizing (buffered: one write per FLUSH_TOKENS), memory-mapped once `close()`d."""

    FLUSH_TOKENS = 1 << 17

    def __init__(self, folder, name):
        self.ids_path = os.path.join(folder, f"{name}.ids.i32")
        self.mask_path = os.path.join(folder, f"{name}.mask.u8")
        self._ids = open(self.ids_path, "wb")
        self._mask = open(self.mask_path, "wb")
        self.n_tokens = self.n_counted = self.n_docs = 0
        self.ids = self.mask = None
        self._buf, self._buffered = [], 0

    def append(self, ids, mask):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8, "the files hold int32 ids, uint8 mask"
        self._buf.append((ids, mask))
        self._buffered += len(ids)
        self.n_tokens += len(ids)
        self.n_counted += int(mask.sum())
        self.n_docs += 1
        if self._buffered >= self.FLUSH_TOKENS:
            self._flush()

    def _flush(self):
        if self._buf:
            np.concatenate([i for i, _ in self._buf]).tofile(self._ids)
            np.concatenate([m for _, m in self._buf]).tofile(self._mask)
        self._buf, self._buffered = [], 0

    def close(self):
        if self._ids.closed:
            return
        self._flush()
        self._ids.close()
        self._mask.close()
        if self.n_tokens:
            self.ids = np.memmap(self.ids_path, dtype=np.int32, mode="r")
            self.mask = np.memmap(self.mask_path, dtype=np.uint8, mode="r")
        else:
            self.ids, self.mask = np.zeros(0, np.int32), np.zeros(0, np.uint8)

    def n_rows(self, seq):
        return math.ceil(self.n_tokens / seq)

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
    """A tokenized, packed dataset: `.train` and `.eval` TokenStores, `.seq`, `.pad_id`."""

    def __init__(self, train, eval_, seq, pad_id, folder, owns_folder):
        self.train, self.eval, self.seq, self.pad_id = train, eval_, seq, pad_id
        self.folder = folder
        if owns_folder:  # a temporary cache goes when the dataset does
            self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)

    @property
    def n_train_rows(self):
        return self.train.n_rows(self.seq)

    def batches(self, batch, seed=0, state=None):
        """An endless, resumable iterator of training batches (see BatchIterator)."""
        return BatchIterator(self, batch, seed, state)

    def eval_batches(self, batch):
        """The eval rows in order, in batches of `batch`; the last is padded with rows that
        count nothing (labels all -100)."""
        n = self.eval.n_rows(self.seq)
        for start in range(0, n, batch):
            index = np.arange(start, min(start + batch, n))
            ids, labels = self.eval.rows(index, self.seq, self.pad_id)
            if len(index) < batch:
                fill = batch - len(index)
                ids = np.concatenate([ids, np.full((fill, self.seq), self.pad_id, np.int64)])
                labels = np.concatenate([labels, np.full((fill, self.seq), IGNORE, np.int64)])
            yield {"input_ids": ids, "labels": labels}

    def describe(self):
        return {"train_docs": self.train.n_docs, "train_tokens": self.train.n_tokens,
                "train_counted": self.train.n_counted, "train_rows": self.n_train_rows,
                "eval_docs": self.eval.n_docs, "eval_tokens": self.eval.n_tokens,
                "eval_counted": self.eval.n_counted, "eval_rows": self.eval.n_rows(self.seq)}


class BatchIterator:
    """Yields {"input_ids", "labels"} int64 [batch, seq] forever, epoch after epoch.

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
        ids, labels = self.data.train.rows(np.asarray(rows), self.data.seq, self.data.pad_id)
        return {"input_ids": ids, "labels": labels}


def is_eval_doc(i, fraction):
    """Document i belongs to the eval split: evenly one in every 1/fraction documents."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def load_dataset(path, tokenizer, seq, vocab_size, eval_fraction=0.05, eval_path=None,
                 cache_dir=None, chunk_docs=CHUNK_DOCS) -> PackedData:
    """Tokenize and pack a data file (streaming) into a PackedData.

    With eval_path the eval split is that file; else every 1/eval_fraction-th document
    of `path` (and at least one, where the file has two or more documents).
    """
    if seq < 2:
        raise LoracError(f"sequence length must be at least 2, got {seq}")
    owns = cache_dir is None
    folder = tempfile.mkdtemp(prefix="lorac-data-") if owns else cache_dir
    os.makedirs(folder, exist_ok=True)
    train, eval_ = TokenStore(folder, "train"), TokenStore(folder, "eval")
    try:
        _fill(path, eval_path, eval_fraction, tokenizer, vocab_size, chunk_docs, train, eval_)
    except BaseException:
        train.close()
        eval_.close()
        if owns:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return PackedData(train, eval_, int(seq), tokenizer.eos_id, folder, owns)


def _fill(path, eval_path, eval_fraction, tokenizer, vocab_size, chunk_docs, train, eval_):
    split = eval_path is None and eval_fraction > 0
    pending = None  # the latest train document, held back until we know eval is not empty
    for doc_index, tokens in _tokenized_docs(path, tokenizer, vocab_size, chunk_docs):
        if split and is_eval_doc(doc_index, eval_fraction):
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
