"""The record formats people's datasets come in, mapped onto the ones encode.py tokenizes.

    alpaca    {"instruction", "input"?, "output", "system"?}  -> a user turn (instruction, then
              the input after a blank line) and the assistant's answer; without a chat template
              a "### Instruction / ### Input / ### Response" prompt and its completion
    sharegpt  {"conversations": [{"from": "human"|"gpt"|"system", "value"}], "system"?}
              (or {"role", "content"} turns) -> chat messages

Only the answers count in the loss, as for encode.py's own prompt/completion and chat records.
"""
from __future__ import annotations

from ..errors import LoracError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "system": "system"}


def normalize_record(record: dict, has_chat_template: bool, where: str) -> dict:
    """An alpaca or sharegpt record as a messages or prompt/completion record; others unchanged."""
    if "conversations" in record:
        return {"messages": _sharegpt_messages(record, where)}
    if "instruction" in record and "output" in record:
        return _alpaca(record, has_chat_template, where)
    return record


def _strings(record, keys, where, kind):
    values = [record.get(k) or "" for k in keys]
    if not all(isinstance(v, str) for v in values):
        raise LoracError(f"{where}: {kind} fields {', '.join(keys)} must be strings")
    return values


def _alpaca(record, has_chat_template, where):
    instruction, extra, output, system = _strings(record, ("instruction", "input", "output", "system"), where, "alpaca")
    if has_chat_template:
        user = instruction + (f"\n\n{extra}" if extra else "")
        turns = [{"role": "system", "content": system}] if system else []
        return {"messages": turns + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}
    prompt = (f"{system}\n\n" if system else "") + f"### Instruction:\n{instruction}\n\n"
    prompt += (f"### Input:\n{extra}\n\n" if extra else "") + "### Response:\n"
    return {"prompt": prompt, "completion": output}


def _sharegpt_messages(record, where):
    turns = record["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise LoracError(f"{where}: \"conversations\" must be a list of {{from, value}} objects")
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
    for t in turns:
        speaker = t.get("from") if t.get("from") is not None else t.get("role")
        text = t.get("value") if t.get("value") is not None else t.get("content")
        if speaker not in SHAREGPT_ROLES or not isinstance(text, str):
            raise LoracError(f"{where}: a sharegpt turn needs \"from\" (one of {', '.join(SHAREGPT_ROLES)}) and a "
                             f"string \"value\", got {speaker!r}")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": text})
    return messages
