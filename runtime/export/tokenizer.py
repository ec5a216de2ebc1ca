"""The tokenizer and generation files of a merged export whose base came without them (a
GGUF file), so that `AutoTokenizer.from_pretrained(out)`, `GenerationConfig.from_pretrained(out)`
and llama.cpp's convert_hf_to_gguf.py read the merged directory as they read a model's own:

    tokenizer.json           the `tokenizers` tokenizer lorac built from the GGUF vocabulary,
                             with a post-processor that prepends BOS where the model wants it
    tokenizer_config.json    PreTrainedTokenizerFast, special tokens, chat template,
                             add_bos_token, model_max_length
    special_tokens_map.json  bos / eos / unk / pad
    generation_config.json   bos / eos / pad ids
"""
from __future__ import annotations

import json
from pathlib import Path


def _special(tok, tid):
    return None if tid is None or tid >= tok.vocab_size else tok.backend.id_to_token(int(tid))


def write_tokenizer_files(out: Path, tok, config: dict) -> None:
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_str(tok.backend.to_str())  # a copy: lorac's own adds BOS itself
    if tok.add_bos:
        bos = tok.bos_token
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                              special_tokens=[(bos, tok.bos_id)])
    backend.save(str(out / "tokenizer.json"))
    unk = getattr(backend.model, "unk_token", None)
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": unk,
               "pad_token": _special(tok, config.get("pad_token_id"))}
    special = {k: v for k, v in special.items() if v is not None}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": tok.add_bos,
                  "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "model_max_length": int(config.get("max_position_embeddings", 2048))}
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "special_tokens_map.json", special)
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    _write_json(out / "generation_config.json", ids)


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
