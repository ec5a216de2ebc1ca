"""SentencePiece vocabularies in GGUF files (Llama 2, Mistral 7B v0.1): a SentencePiece BPE
model trained here on the bundled corpus (byte fallback, identity normalization, as Llama's)
is written into a GGUF file the way llama.cpp's converter writes one; lorac's tokenizer from
that file must give the ids SentencePiece itself gives, and decode them back."""
import io
import json

import numpy as np
import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

from lorac.runtime.model.default import default_corpus  # noqa: E402
from lorac.runtime.model.tokenizer import load_tokenizer  # noqa: E402
from test_gguf import TEXTS  # noqa: E402

KIND = {"unknown": 2, "control": 3, "byte": 6, "unused": 5}


def corpus_lines():
    with open(default_corpus()[0]) as f:
        return [m["content"] for line in f for m in json.loads(line)["messages"]]


@pytest.fixture(scope="module")
def sp_and_gguf(tmp_path_factory):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines()), model_writer=model, vocab_size=800,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    n = sp.get_piece_size()
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([next((k for name, k in KIND.items() if getattr(sp, f"is_{name}")(i)), 1) for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, path


def test_spm_gguf_tokenizer_matches_sentencepiece(sp_and_gguf):
    sp, path = sp_and_gguf
    tok = load_tokenizer(path)
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.add_bos
    texts = [t for t in TEXTS if "<|im_" not in t] + corpus_lines()[-40:]
    merged = 0
    for text in texts:
        ids = tok.encode(text, add_bos=False).tolist()
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text
        merged += len(ids) < len(text)
    assert merged >= 0.8 * len(texts)  # the merges work: most texts take fewer tokens than characters
    assert tok.encode("hacker")[0] == 1  # BOS first, as the file says


def test_spm_offsets_cover_the_text(sp_and_gguf):
    """data.py masks by character offsets: each token's span must lie in the original text."""
    _, path = sp_and_gguf
    tok = load_tokenizer(path)
    text = "What does kludge mean?  A clever hack."
    enc = tok.encode_batch([text])[0]
    spans = np.asarray(enc.offsets)
    assert spans[0, 0] == 0 and spans[-1, 1] == len(text) and (spans[:, 1] >= spans[:, 0]).all()
