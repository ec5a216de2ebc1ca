"""Data people have: alpaca and sharegpt records tokenize exactly as the chat (or
prompt/completion) records they stand for; HF datasets (parquet, arrow, a save_to_disk
folder, a hub dataset id from the local HF cache with the hub unreachable) and JSON-array
files give the same tokens as the same records in JSONL."""
import json

import numpy as np
import pytest

from lorac.runtime.data import load_dataset
from lorac.runtime.errors import LoracError
from lorac.runtime.model.tokenizer import Tokenizer
from test_data import tok, write_jsonl  # noqa: F401 - tok is a fixture

ALPACA = [{"instruction": "what is foo", "input": "the bar", "output": "foo is a kludge"},
          {"instruction": "name a lazy dog", "input": "", "output": "the dog", "system": "be brief"}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "what is cruft"}, {"from": "gpt", "value": "jargon term"},
                               {"from": "human", "value": "and baz"}, {"from": "gpt", "value": "foo bar"}]},
            {"system": "answer", "conversations": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "the fox"}]}]


def tokens(path, tokenizer):
    ds = load_dataset(path, tokenizer, seq=8, vocab_size=tokenizer.vocab_size, eval_fraction=0)
    return np.asarray(ds.train.ids).tolist(), np.asarray(ds.train.mask).tolist()


def test_alpaca_is_a_chat(tmp_path, tok):
    chats = [{"messages": [{"role": "user", "content": "what is foo\n\nthe bar"},
                           {"role": "assistant", "content": "foo is a kludge"}]},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a lazy dog"},
                           {"role": "assistant", "content": "the dog"}]}]
    got = tokens(write_jsonl(tmp_path / "a.jsonl", ALPACA), tok)
    assert got == tokens(write_jsonl(tmp_path / "c.jsonl", chats), tok)
    assert sum(got[1]) < len(got[1]) / 2  # only the answers count


def test_alpaca_without_chat_template_is_prompt_completion(tmp_path, tok):
    plain = Tokenizer(tok.backend, tok.eos_id, source="no template")
    pc = [{"prompt": "### Instruction:\nwhat is foo\n\n### Input:\nthe bar\n\n### Response:\n",
           "completion": "foo is a kludge"},
          {"prompt": "be brief\n\n### Instruction:\nname a lazy dog\n\n### Response:\n", "completion": "the dog"}]
    assert tokens(write_jsonl(tmp_path / "a.jsonl", ALPACA), plain) == tokens(write_jsonl(tmp_path / "p.jsonl", pc), plain)


def test_sharegpt_is_a_chat(tmp_path, tok):
    role = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}
    chats = [{"messages": ([{"role": "system", "content": r["system"]}] if "system" in r else [])
              + [{"role": role[t.get("from", t.get("role"))], "content": t.get("value", t.get("content"))}
                 for t in r["conversations"]]} for r in SHAREGPT]
    assert tokens(write_jsonl(tmp_path / "s.jsonl", SHAREGPT), tok) == tokens(write_jsonl(tmp_path / "c.jsonl", chats), tok)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(LoracError, match=r"bad.jsonl:1: a sharegpt turn needs \"from\" .* got 'robot'"):
        tokens(bad, tok)


def test_json_array_file(tmp_path, tok):
    (tmp_path / "alpaca_data.json").write_text(json.dumps(ALPACA))
    assert tokens(tmp_path / "alpaca_data.json", tok) == tokens(write_jsonl(tmp_path / "a.jsonl", ALPACA), tok)


def test_hf_datasets_sources(tmp_path, tok, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from huggingface_hub import constants
    from test_hub import cache_repo
    want = tokens(write_jsonl(tmp_path / "s.jsonl", SHAREGPT + ALPACA), tok)
    # one table of both kinds: datasets fills the other kind's columns with None
    rows = [{**{"conversations": None, "system": None, "instruction": None, "input": None, "output": None}, **r}
            for r in SHAREGPT + ALPACA]
    data = datasets.Dataset.from_list(rows)
    data.to_parquet(str(tmp_path / "d.parquet"))
    data.save_to_disk(str(tmp_path / "saved"))
    assert tokens(tmp_path / "d.parquet", tok) == want
    assert tokens(tmp_path / "saved", tok) == want
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert tokens(arrow, tok) == want
    cache_repo(tmp_path / "hub", "org/chats", {"data/train.parquet": (tmp_path / "d.parquet").read_bytes()},
               kind="datasets")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert tokens("org/chats", tok) == want
    with pytest.raises(LoracError, match="data not found: org/absent is neither a local path nor in the Hugging Face cache"):
        tokens("org/absent", tok)
