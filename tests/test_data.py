"""Datasets: packing, loss masks that count exactly the answer tokens, the eval split,
the resumable iterator, streaming, and one clear line for each kind of bad data."""

import json
import tracemalloc

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

from lorac.runtime.data import IGNORE, is_eval_doc, load_dataset, read_records
from lorac.runtime.errors import LoracError
from lorac.runtime.model.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ("the quick brown fox jumps over a lazy dog while hackers write cruft and kludges "
         "in C with foo bar baz answer question what is means term jargon").split()


@pytest.fixture(scope="module")
def tok():
    """A small byte-level BPE with ChatML specials, trained here (no files, no network)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(0)
    backend.train_from_iterator([" ".join(rng.choice(WORDS, 12)) for _ in range(300)], trainer)
    return Tokenizer(backend, eos_id=backend.token_to_id("<|im_end|>"), bos_id=None,
                     chat_template=CHATML, source="test")


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def counted_text(tok, ds):
    """Concatenated decoded text of all counted train tokens, in stream order."""
    ids, mask = np.asarray(ds.train.ids), np.asarray(ds.train.mask)
    return tok.decode(ids[mask > 0], skip_special=False)


def test_text_packing_with_eos_separators(tmp_path, tok):
    docs = [" ".join(WORDS[i:i + 7]) for i in range(12)]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    stream = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs])
    if len(stream) % 16 == 0:  # keep a partial last row, whose padding is checked below
        docs, stream = docs[:-1], stream[:-len(tok.encode(docs[-1])) - 1]
        path = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    ds = load_dataset(path, tok, seq=16, vocab_size=tok.vocab_size, eval_fraction=0)
    assert ds.train.n_tokens == len(stream) and ds.eval.n_tokens == 0
    it = ds.batches(batch=2, seed=0)
    rows = {}
    for _ in range(ds.n_train_rows):  # one epoch in permuted order covers every row once
        b = next(it)
        assert b["input_ids"].shape == (2, 16) and b["input_ids"].dtype == np.int64
        assert b["labels"].dtype == np.int64
        for r in range(2):
            rows[tuple(b["input_ids"][r])] = b["labels"][r]
    flat = np.concatenate([ds.train.rows(np.array([r]), 16, tok.eos_id)[0][0] for r in range(ds.n_train_rows)])
    assert np.array_equal(flat[:len(stream)], stream)
    assert np.all(flat[len(stream):] == tok.eos_id)  # padding of the last row
    last_ids, last_labels = ds.train.rows(np.array([ds.n_train_rows - 1]), 16, tok.eos_id)
    pad = ds.n_train_rows * 16 - len(stream)
    assert pad > 0 and np.all(last_labels[0, 16 - pad:] == IGNORE)
    for ids, labels in rows.items():  # text: every real token counts
        assert np.array_equal(np.asarray(ids)[labels != IGNORE], labels[labels != IGNORE])


def test_prompt_completion_counts_exactly_the_completion(tmp_path, tok):
    recs = [{"prompt": f"what is {w}?\n", "completion": f"{w} means the {WORDS[i]} fox"} for i, w in enumerate(WORDS[:9])]
    path = write_jsonl(tmp_path / "pc.jsonl", recs)
    ds = load_dataset(path, tok, seq=32, vocab_size=tok.vocab_size, eval_fraction=0)
    expect = sum(len(tok.encode(r["completion"])) + 1 for r in recs)  # + EOS, which counts
    assert ds.train.n_counted == expect
    assert counted_text(tok, ds) == "".join(r["completion"] + "<|im_end|>" for r in recs)
    b = next(ds.batches(4, seed=3))
    assert (b["labels"] != IGNORE).sum() > 0


def test_prompt_ending_in_blank_counts_the_first_answer_word(tmp_path, tok):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "what is foo? ", "completion": "bar baz"}] * 2)
    ds = load_dataset(path, tok, seq=32, vocab_size=tok.vocab_size, eval_fraction=0)
    assert counted_text(tok, ds) == " bar baz<|im_end|>" * 2  # "Ġbar" straddles: it counts


def test_chat_counts_exactly_the_assistant_turns(tmp_path, tok):
    chats = [{"messages": [{"role": "system", "content": "be terse"},
                           {"role": "user", "content": f"what is {w}?"},
                           {"role": "assistant", "content": f"{w} means cruft"},
                           {"role": "user", "content": "and foo?"},
                           {"role": "assistant", "content": "foo is bar"}]} for w in WORDS[:6]]
    path = write_jsonl(tmp_path / "chat.jsonl", chats)
    ds = load_dataset(path, tok, seq=64, vocab_size=tok.vocab_size, eval_fraction=0)
    answers = "".join(f"{w} means cruft<|im_end|>\nfoo is bar<|im_end|>\n" for w in WORDS[:6])
    assert counted_text(tok, ds) == answers
    # no extra EOS: the rendering ends in "<|im_end|>\n" already
    rendered = tok.render_chat(chats[0]["messages"])
    assert ds.train.n_tokens == 6 * len(tok.encode(rendered))
    mask = np.asarray(ds.train.mask)
    assert mask.sum() == sum(len(tok.encode(f"{w} means cruft<|im_end|>\nfoo is bar<|im_end|>\n")) for w in WORDS[:6])


def test_plain_text_paragraphs(tmp_path, tok):
    p = tmp_path / "c.txt"
    p.write_text("the quick fox\njumps over\n\n\nthe lazy dog\n\nfoo bar\n")
    recs = [r for _, r in read_records(p)]
    assert [r["text"] for r in recs] == ["the quick fox\njumps over", "the lazy dog", "foo bar"]
    ds = load_dataset(p, tok, seq=8, vocab_size=tok.vocab_size, eval_fraction=0)
    assert ds.train.n_docs == 3 and counted_text(tok, ds) == "".join(r["text"] + "<|im_end|>" for r in recs)


def test_long_paragraph_is_cut_without_eos(tmp_path, tok, monkeypatch):
    import lorac.runtime.data.read as data
    monkeypatch.setattr(data, "MAX_PARAGRAPH", 20)
    p = tmp_path / "long.txt"
    p.write_text("the quick brown fox\njumps over the lazy\ndog\n")
    recs = [r for _, r in read_records(p)]
    assert [r["eos"] for r in recs] == [False, False, True] and [r["bos"] for r in recs] == [True, False, False]
    ds = load_dataset(p, tok, seq=8, vocab_size=tok.vocab_size, eval_fraction=0)
    assert tok.decode(np.asarray(ds.train.ids), skip_special=False).count("<|im_end|>") == 1


# ---------------------------------------------------------------- split and order

def test_eval_split_is_deterministic_and_disjoint(tmp_path, tok):
    docs = [f"{a} {b}" for a in WORDS[:10] for b in WORDS[10:20]]  # 100 distinct documents
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    ds = load_dataset(path, tok, seq=16, vocab_size=tok.vocab_size, eval_fraction=0.1)
    assert ds.eval.n_docs == 10 and ds.train.n_docs == 90
    assert [i for i in range(100) if is_eval_doc(i, 0.1)] == list(range(9, 100, 10))
    eval_text = tok.decode(np.asarray(ds.eval.ids), skip_special=False)
    assert eval_text == "".join(docs[i] + "<|im_end|>" for i in range(9, 100, 10))
    again = load_dataset(path, tok, seq=16, vocab_size=tok.vocab_size, eval_fraction=0.1)
    assert np.array_equal(np.asarray(again.eval.ids), np.asarray(ds.eval.ids))
    batches = list(ds.eval_batches(4))
    assert len(batches) == -(-ds.eval.n_rows(16) // 4)
    assert all(b["input_ids"].shape == (4, 16) for b in batches)


def test_tiny_corpus_still_gets_an_eval_document(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "foo bar"}, {"text": "the fox"}, {"text": "lazy dog"}])
    ds = load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size, eval_fraction=0.05)
    assert ds.train.n_docs == 2 and ds.eval.n_docs == 1


def test_separate_eval_file(tmp_path, tok):
    train = write_jsonl(tmp_path / "a.jsonl", [{"text": "foo bar"}] * 5)
    ev = write_jsonl(tmp_path / "b.jsonl", [{"text": "lazy dog"}])
    ds = load_dataset(train, tok, seq=8, vocab_size=tok.vocab_size, eval_path=ev)
    assert ds.train.n_docs == 5 and tok.decode(np.asarray(ds.eval.ids), skip_special=False) == "lazy dog<|im_end|>"


def test_iterator_is_seeded_and_resumes_exactly(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": " ".join(WORDS[i:i + 9])} for i in range(20)])
    ds = load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size, eval_fraction=0)
    n = ds.n_train_rows
    steps = 2 * n // 3 + 3  # runs across at least one epoch boundary with batch 3
    run = [next(it) for it in [ds.batches(3, seed=7)] for _ in range(steps)]
    same = [next(it) for it in [ds.batches(3, seed=7)] for _ in range(steps)]
    other = next(ds.batches(3, seed=8))
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(run, same))
    assert not np.array_equal(run[0]["input_ids"], other["input_ids"])
    # each epoch is a permutation: the first n rows of the stream are all rows once
    first_epoch = np.concatenate([b["input_ids"] for b in run])[:n]
    assert len({tuple(r) for r in first_epoch}) == len({tuple(r) for r in ds.train.rows(np.arange(n), 8, 0)[0]})

    it = ds.batches(3, seed=7)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.state()))  # a checkpoint stores it as JSON
    assert set(state) == {"epoch", "index", "seed"}
    resumed = ds.batches(3, seed=123, state=state)  # the state's seed wins
    for k in range(5, steps):
        b = next(resumed)
        assert np.array_equal(b["input_ids"], run[k]["input_ids"]) and np.array_equal(b["labels"], run[k]["labels"])
    with pytest.raises(LoracError, match="past this dataset"):
        ds.batches(3, state={"epoch": 0, "index": n + 1, "seed": 7})


def test_streaming_keeps_memory_bounded(tmp_path, tok):
    """A 5+ MB JSONL tokenized with bounded Python/numpy memory: the whole file is never held."""
    path = tmp_path / "big.jsonl"
    rng = np.random.default_rng(0)
    line = [json.dumps({"text": " ".join(rng.choice(WORDS, 400))}) for _ in range(50)]
    with open(path, "w") as f:
        for i in range(2900):
            f.write(line[i % 50] + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    ds = load_dataset(path, tok, seq=128, vocab_size=tok.vocab_size, eval_fraction=0.01, chunk_docs=64)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size > 5e6 and ds.train.n_docs + ds.eval.n_docs == 2900
    # the bound is the write buffer (FLUSH_TOKENS) plus one chunk, not the file or its tokens
    assert peak < size / 3, f"peak {peak} bytes while reading {size} bytes"


# ---------------------------------------------------------------- bad data

def test_bad_json_line_is_named(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "foo"}, "", '{"text": "bar"', {"text": "x"}])
    with pytest.raises(LoracError, match=r"bad\.jsonl:3: not valid JSON"):
        load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)
    path = write_jsonl(tmp_path / "arr.jsonl", ["[1, 2]"])
    with pytest.raises(LoracError, match=r"arr\.jsonl:1: a JSON object is expected"):
        load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)
    path = write_jsonl(tmp_path / "keys.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(LoracError, match=r"keys\.jsonl:2: record has none of the keys"):
        load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)


def test_empty_dataset(tmp_path, tok):
    for name, content in (("e.jsonl", ""), ("blank.jsonl", "\n\n  \n"), ("e.txt", "\n\n")):
        p = tmp_path / name
        p.write_text(content)
        with pytest.raises(LoracError, match="dataset is empty"):
            load_dataset(p, tok, seq=8, vocab_size=tok.vocab_size)
    with pytest.raises(LoracError, match="data file not found"):
        load_dataset(tmp_path / "none.jsonl", tok, seq=8, vocab_size=tok.vocab_size)


def test_token_id_beyond_vocab(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "foo"}, {"text": "the quick brown fox"}])
    with pytest.raises(LoracError, match=r"t\.jsonl:\d+: token id \d+ >= the model's vocab size 10"):
        load_dataset(path, tok, seq=8, vocab_size=10)


def test_chat_file_without_template(tmp_path, tok):
    bare = Tokenizer(tok.backend, eos_id=tok.eos_id, chat_template=None, source="bare-model")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "foo"}]}])
    with pytest.raises(LoracError, match="bare-model has no chat template"):
        load_dataset(path, bare, seq=8, vocab_size=tok.vocab_size)


def test_bad_records(tmp_path, tok):
    cases = [({"prompt": "a"}, "must both be strings"), ({"messages": "hi"}, "must be a list"),
             ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
             ({"text": 5}, "must be a string")]
    for record, message in cases:
        path = write_jsonl(tmp_path / "r.jsonl", [record])
        with pytest.raises(LoracError, match=r"r\.jsonl:1: .*" + message):
            load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)


def test_bundled_corpus_is_small_and_valid(tok):
    from lorac.runtime.model.default import default_corpus
    train, ev = default_corpus()
    recs = [r for _, r in read_records(train)]
    evs = [r for _, r in read_records(ev)]
    assert 500 <= len(recs) <= 2000 and 20 <= len(evs) <= 100
    terms = {r["messages"][0]["content"] for r in recs}
    assert not terms & {r["messages"][0]["content"] for r in evs}  # held-out terms
    ds = load_dataset(train, tok, seq=256, vocab_size=tok.vocab_size, eval_path=ev)
    assert ds.train.n_counted > 0 and ds.eval.n_counted > 0


# ---------------------------------------------------------------- rows, long documents, temp folders

def _counted_targets(labels):
    return (labels[:, 1:] != IGNORE).sum(axis=1)  # the graph predicts token t+1 from t


def test_rows_without_an_answer_token_are_dropped_and_counted(tmp_path, tok):
    long_prompt = " ".join(WORDS * 3)  # ~75 tokens: fills whole rows of 16 with no answer
    recs = [{"prompt": long_prompt if i % 2 else "what is foo? ", "completion": "foo is bar"} for i in range(12)]
    ds = load_dataset(write_jsonl(tmp_path / "p.jsonl", recs), tok, seq=16, vocab_size=tok.vocab_size, eval_fraction=0.25)
    d = ds.describe()
    assert d["train_rows_without_answer"] > 0 and d["train_rows"] + d["train_rows_without_answer"] == ds.train.n_rows(16)
    it = ds.batches(4, seed=0)
    for _ in range(3 * d["train_rows"]):  # several epochs: every row in view counts something
        assert (_counted_targets(next(it)["labels"]) > 0).all()
    evals = [b["labels"] for b in ds.eval_batches(2)]
    assert sum(len(b) for b in evals) >= d["eval_rows"]
    assert all((_counted_targets(b) > 0).sum() > 0 for b in evals)


def test_a_dataset_with_no_answer_in_view_is_refused(tmp_path, tok):
    # a prompt of an even number of tokens and an empty answer: the only counted token, EOS,
    # opens the last row of 2, where it is no target; every row of the dataset counts nothing
    prompt = next(p for p in (" ".join(WORDS[:k]) for k in range(3, 20)) if len(tok.encode(p)) % 2 == 0)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "completion": ""}])
    with pytest.raises(LoracError, match=r"p\.jsonl: all \d+ training rows were dropped: rows of 2 tokens in which no "
                                         r"answer token follows"):
        load_dataset(path, tok, seq=2, vocab_size=tok.vocab_size, eval_fraction=0)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"text": "foo bar baz the quick brown fox"}] * 4)
    with pytest.raises(LoracError, match=r"p\.jsonl: all \d+ eval rows were dropped"):
        load_dataset(ok, tok, seq=2, vocab_size=tok.vocab_size, eval_path=path)


def _long_prompt_records():
    """12 prompt/completion records, every other one with a prompt of ~75 tokens (rows of 16)."""
    long_prompt = " ".join(WORDS * 3)
    return [{"prompt": (long_prompt if i % 2 else "what is foo? ") + WORDS[i] + " ", "completion": "foo is bar " + WORDS[i]}
            for i in range(12)]


def test_dropped_rows_are_told_with_their_share_and_the_fix(tmp_path, tok):
    from lorac.runtime.train.report import data_lines
    ds = load_dataset(write_jsonl(tmp_path / "p.jsonl", _long_prompt_records()), tok, seq=16,
                      vocab_size=tok.vocab_size, eval_fraction=0)
    d = ds.describe()
    left, total = d["train_rows_without_answer"], ds.train.n_rows(16)
    assert left > 0 and d["truncate"] == "none" and d["train_prompts_cut"] == d["train_pad_tokens"] == 0
    line, warning = data_lines("p.jsonl", d)
    assert line.startswith(f"data: p.jsonl: 12 documents, {ds.train.n_tokens:,} tokens ({ds.train.n_counted:,} in "
                           f"the loss) -> {total:,} rows of 16 tokens, {total - left:,} used ({left:,} left out: "
                           "no answer token)") and line.endswith("; packing plain")
    assert warning.startswith(f"warning: {left:,} of {total:,} training rows ({left / total:.0%}) hold no answer token")
    assert "raise --seq, or add --truncate prompt-left" in warning
    short = [r | {"prompt": "what is foo? "} for r in _long_prompt_records()]
    ds = load_dataset(write_jsonl(tmp_path / "s.jsonl", short), tok, seq=16, vocab_size=tok.vocab_size, eval_fraction=0)
    assert ds.describe()["train_rows_without_answer"] == 0 and len(data_lines("s.jsonl", ds.describe())) == 1


@pytest.mark.parametrize("packing", ["plain", "isolated"])
def test_truncate_prompt_left_keeps_each_answer_whole_in_one_row(tmp_path, tok, packing):
    seq, recs = 16, _long_prompt_records()
    path = write_jsonl(tmp_path / "p.jsonl", recs)
    ds = load_dataset(path, tok, seq=seq, vocab_size=tok.vocab_size, eval_fraction=0, packing=packing,
                      truncate="prompt-left")
    whole = [np.append(tok.encode(r["prompt"] + r["completion"]), tok.eos_id) for r in recs]
    answers = [len(tok.encode(r["prompt"] + r["completion"])) - len(tok.encode(r["prompt"])) + 1 for r in recs]
    assert max(answers) < seq  # every answer fits a row, with some of its prompt
    d = ds.describe()
    long = [w for w in whole if len(w) > seq]
    assert d["train_prompts_cut"] == len(long) > 0
    assert d["train_prompt_tokens_cut"] == sum(len(w) - seq for w in long)
    assert d["train_rows_without_answer"] == 0 and d["truncate"] == "prompt-left"
    ids, mask, starts = np.asarray(ds.train.ids), np.asarray(ds.train.mask), np.asarray(ds.train.starts).tolist()
    segments = [(a, b) for a, b in zip(starts, starts[1:] + [ds.train.n_tokens])]
    docs = [(a, b) for a, b in segments if mask[a:b].any()]
    pads = [(a, b) for a, b in segments if not mask[a:b].any()]
    assert all((ids[a:b] == tok.eos_id).all() and b % seq == 0 for a, b in pads)  # pads fill a row to its end
    assert sum(b - a for a, b in pads) == d["train_pad_tokens"] == ds.train.n_tokens - sum(min(len(w), seq) for w in whole)
    assert len(docs) == d["train_docs"] == 12
    for (a, b), w in zip(docs, whole):  # in file order, each in one row, the end of the document kept
        assert a // seq == (b - 1) // seq and ids[a:b].tolist() == w[-seq:].tolist()
    assert counted_text(tok, ds) == counted_text(tok, load_dataset(path, tok, seq=seq, vocab_size=tok.vocab_size,
                                                                   eval_fraction=0))  # no answer token lost
    for a, b in docs:  # each document's own positions: it sees its whole kept prompt and nothing before
        row = ds.batch(ds.train, np.asarray([a // seq]))
        if packing == "isolated":
            assert row["position_ids"][0, a % seq:a % seq + b - a].tolist() == list(range(b - a))
        assert (row["labels"][0, a % seq:a % seq + b - a] != IGNORE).sum() > 0


def test_prompt_left_keeps_a_leading_bos_and_never_cuts_an_answer():
    from lorac.runtime.data.fit import PromptLeft

    class Store:  # what PromptLeft.place reads and calls
        n_tokens, padded = 5, []

        def pad(self, n):
            self.padded.append(n)

    fit, store = PromptLeft(seq=8, bos_id=7), Store()
    ids, mask = np.arange(7, 19, dtype=np.int32), np.asarray([0] * 9 + [1] * 3, np.uint8)  # BOS, 8 prompt, 3 answer
    out, kept = fit.place(store, ids, mask)
    assert out.tolist() == [7, 12, 13, 14, 15, 16, 17, 18] and kept.tolist() == [0] * 5 + [1] * 3
    assert (fit.docs_cut, fit.tokens_cut, store.padded) == (1, 4, [3])  # 5 used + 8 > 8: the next row
    mask = np.asarray([0, 0] + [1] * 10, np.uint8)  # an answer longer than the row: the whole prompt goes, not more
    out, kept = fit.place(store, ids, mask)
    assert out.tolist() == [7] + list(range(9, 19)) and kept.sum() == 10 and fit.tokens_cut == 5
    assert store.padded == [3]  # longer than a row: no padding before it


def test_truncate_is_checked(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", _long_prompt_records())
    with pytest.raises(LoracError, match="--truncate must be one of none, prompt-left, got 'right'"):
        load_dataset(path, tok, seq=16, vocab_size=tok.vocab_size, truncate="right")


def test_long_document_is_tokenized_in_pieces_with_the_same_mask(tmp_path, tok, monkeypatch):
    import lorac.runtime.data as data
    words = [WORDS[i % len(WORDS)] for i in range(3000)]
    rec = {"prompt": " ".join(words[:1000]) + " ", "completion": " ".join(words[1000:])}
    path = write_jsonl(tmp_path / "l.jsonl", [rec])
    whole = load_dataset(path, tok, seq=32, vocab_size=tok.vocab_size, eval_fraction=0)
    monkeypatch.setattr(data.encode, "MAX_PIECE", 500)
    monkeypatch.setattr(data.encode, "ENCODE_CHARS", 2000)
    pieces = load_dataset(path, tok, seq=32, vocab_size=tok.vocab_size, eval_fraction=0)
    # cuts fall before a blank, where byte-level BPE starts a token anyway: the same tokens
    assert np.array_equal(np.asarray(whole.train.ids), np.asarray(pieces.train.ids))
    assert np.array_equal(np.asarray(whole.train.mask), np.asarray(pieces.train.mask))
    assert counted_text(tok, pieces) == " " + rec["completion"] + "<|im_end|>"  # the prompt's blank leads the answer


def test_a_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path, tok, monkeypatch):
    import lorac.runtime.data as data
    monkeypatch.setattr(data.read, "MAX_LINE", 1 << 20)
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "foo"}, {"text": "x" * (3 << 20)}])
    tracemalloc.start()
    with pytest.raises(LoracError, match=r"big\.jsonl:2: line longer than 1 M characters"):
        load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 3 << 20


LONG_LINE = """
import json, resource, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from tiny_model import char_tokenizer
from lorac.runtime.data import load_dataset
from lorac.runtime.model.tokenizer import Tokenizer
tok = Tokenizer(char_tokenizer(), eos_id=1)  # one token per character: the costliest case
path = Path(sys.argv[1]) / "one.jsonl"
path.write_text(json.dumps({{"prompt": "Q: ", "completion": "the quick brown fox jumps. " * 80000}}) + "\\n")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ds = load_dataset(path, tok, 128, tok.vocab_size, eval_fraction=0)
print(ds.train.n_tokens, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_one_long_line_is_tokenized_in_bounded_memory(tmp_path):
    """A 2 MB JSONL line: whole, the tokenizer's working memory grew ~0.9 GB (a 5 MB line: 2 GB)."""
    import subprocess
    import sys
    from pathlib import Path
    code = LONG_LINE.format(tests=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, grew_mb = (int(x) for x in r.stdout.split())
    assert tokens > 2_000_000 and grew_mb < 250, (tokens, grew_mb)


KEEP_DATA = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from tiny_model import char_tokenizer
from lorac.runtime.data import load_dataset
from lorac.runtime.model.tokenizer import Tokenizer
tok = Tokenizer(char_tokenizer(), eos_id=1)
(Path(sys.argv[1]) / "c.txt").write_text("the cat sat\\n\\non the mat\\n")
ds = load_dataset(Path(sys.argv[1]) / "c.txt", tok, 8, tok.vocab_size)
print(ds.folder, flush=True)
time.sleep(60)
"""


def test_temp_folders_of_killed_runs_are_removed_by_the_next(tmp_path, tok, monkeypatch):
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    temp = tmp_path / "tmp"
    temp.mkdir()
    code = KEEP_DATA.format(tests=str(Path(__file__).parent))
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(temp)})
    folder = Path(child.stdout.readline().strip())
    assert folder.parent == temp and folder.name.startswith("lorac-data-")
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "foo bar"}] * 3)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    live = load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)
    assert folder.is_dir()  # its owner still runs: kept
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    child.stdout.close()
    again = load_dataset(path, tok, seq=8, vocab_size=tok.vocab_size)
    assert not folder.exists()  # its owner died: removed
    assert sorted(p.name for p in temp.iterdir()) == sorted([Path(live.folder).name, Path(again.folder).name])
    del live, again
    assert list(temp.iterdir()) == []  # a dataset's folder goes with it
