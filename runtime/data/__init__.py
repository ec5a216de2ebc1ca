"""Training data: documents -> tokens with a loss mask -> packed [batch, seq] rows.

Formats (picked per file by its suffix, per record by its keys):
    plain text (.txt, anything not .jsonl/.json): paragraphs split at blank lines
    JSONL {"text": ...}                        every token counts
    JSONL {"prompt": ..., "completion": ...}   only completion tokens count
    JSONL {"messages": [{"role", "content"}]}  rendered with the chat template; only the
                                               assistant turns count
    alpaca and sharegpt records (formats.py), HF datasets and JSON arrays (sources.py)
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

Here: load_dataset (file -> PackedData) and the split. The pieces: read.py (a file's
records), formats.py (alpaca, sharegpt -> these formats), sources.py (HF datasets, JSON
arrays), encode.py (records -> ids and loss mask), store.py (TokenStore: a split's token
stream on disk), packed.py (PackedData, BatchIterator), temp.py (the temporary folders).
"""

import math
import os

from ..errors import LoracError
from .encode import tokenize_chunk
from .fit import PromptLeft, check_truncation
from .packed import PACKINGS, BatchIterator, PackedData  # noqa: F401 - the package's interface
from .read import read_records
from .store import IGNORE, TokenStore  # noqa: F401 - IGNORE: the package's interface
from .temp import remove_temp, temp_folder

CHUNK_DOCS = 256        # documents tokenized per encode_batch call


def is_eval_doc(i, fraction):
    """Document i belongs to the eval split: evenly one in every 1/fraction documents."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def load_dataset(path, tokenizer, seq, vocab_size, eval_fraction=0.05, eval_path=None,
                 cache_dir=None, chunk_docs=CHUNK_DOCS, packing="plain", truncate="none") -> PackedData:
    """Tokenize and pack a data file (streaming) into a PackedData.

    With eval_path the eval split is that file; else every 1/eval_fraction-th document
    of `path` (and at least one, where the file has two or more documents). `packing`:
    "plain" or "isolated" (module doc). `truncate`: "none", or "prompt-left" (fit.py).
    """
    if seq < 2:
        raise LoracError(f"sequence length must be at least 2, got {seq}")
    check_truncation(truncate)
    owns = cache_dir is None
    folder, lock = temp_folder() if owns else (cache_dir, None)
    os.makedirs(folder, exist_ok=True)
    fit = (lambda: PromptLeft(seq, tokenizer.bos_id)) if truncate == "prompt-left" else (lambda: None)
    train, eval_ = (TokenStore(folder, name, fit(), tokenizer.eos_id) for name in ("train", "eval"))
    try:
        _fill(path, eval_path, eval_fraction, tokenizer, vocab_size, chunk_docs, train, eval_)
        data = PackedData(train, eval_, int(seq), tokenizer.eos_id, folder, owns, lock, packing)
        _check_rows(data, path, eval_path if eval_path is not None else path if eval_fraction > 0 else None)
    except BaseException:
        train.close()
        eval_.close()
        if owns:
            remove_temp(folder, lock)
        raise
    return data


def _check_rows(data, path, eval_path):
    """Refuse a split none of whose rows has a label the loss sees (module doc of PackedData)."""
    why = (f"rows of {data.seq} tokens in which no answer token follows the row's first position "
           "(prompts longer than the sequence length?); raise --seq or shorten the prompts"
           + ("" if data.train.fit else " (--truncate prompt-left cuts them from the left)"))
    if data.n_train_rows == 0:
        raise LoracError(f"{path}: all {data.train.n_rows(data.seq)} training rows were dropped: {why}")
    if eval_path is not None and data.eval.n_tokens and len(data.eval_rows) == 0:
        raise LoracError(f"{eval_path}: all {data.eval.n_rows(data.seq)} eval rows were dropped: {why}")


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
