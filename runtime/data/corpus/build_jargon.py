"""Rebuild jargon_train.jsonl / jargon_eval.jsonl from the Jargon File (public domain).

    apt-get install jargon-text
    python runtime/data/corpus/build_jargon.py /usr/share/doc/jargon-text/jargon.txt.gz

Each lexicon entry (":term: pronunciation, part of speech" then paragraphs) becomes one
chat: the user asks what the term means, the assistant answers with the entry's first
sense, cross-reference braces ({cruft}) removed. Entries whose first sense is only a
pointer ("See {foo}.") or too short/long for a ~256-token row are skipped; every 20th
kept entry goes to the eval file, so eval terms are never trained on.
"""

import gzip
import json
import re
import sys

QUESTIONS = (
    "What does the hacker jargon term \u201c{t}\u201d mean?",
    "In hacker slang, what is meant by \u201c{t}\u201d?",
    "Explain the jargon term \u201c{t}\u201d.",
)
MIN_CHARS, MAX_CHARS = 120, 700   # about 30..180 tokens of answer
EVAL_EVERY = 20
KEEP_EVERY = 2                    # keep every 2nd usable entry: ~300 KB in all


def entries(text):
    """Yield (term, [paragraphs]) from the lexicon part of jargon.txt."""
    head = re.compile(r"^   :(.+?):(.*)$")
    term, paras, para = None, [], []
    for line in text.splitlines():
        m = head.match(line)
        if m:
            if term:
                yield term, paras + ([" ".join(para)] if para else [])
            term, paras, para = m.group(1).strip(), [], []
        elif term is not None:
            if line.strip():
                para.append(line.strip())
            elif para:
                paras.append(" ".join(para))
                para = []
    if term:
        yield term, paras + ([" ".join(para)] if para else [])


def first_sense(paras):
    """The first paragraph that defines: a leading [usage note] and '1. ' numbering dropped."""
    for p in paras:
        p = re.sub(r"^1\.\s+", "", re.sub(r"^\[[^\]]*\]\s*", "", p))
        if len(p) < 20:  # the paragraph was only a usage note
            continue
        p = re.sub(r"\{([^{}]*)\}", r"\1", p)
        return re.sub(r"\s+", " ", p).strip()
    return ""


def main(src, out_dir):
    with gzip.open(src, "rt", encoding="utf-8") if src.endswith(".gz") else open(src, encoding="utf-8") as f:
        text = f.read()
    usable = []
    for term, paras in entries(text):
        answer = first_sense(paras)
        if not (MIN_CHARS <= len(answer) <= MAX_CHARS) or re.match(r"(See|Syn\.|Var\.|Abbrev)", answer):
            continue
        usable.append((term, answer))
    kept = usable[::KEEP_EVERY]
    files = {"train": open(f"{out_dir}/jargon_train.jsonl", "w", encoding="utf-8"),
             "eval": open(f"{out_dir}/jargon_eval.jsonl", "w", encoding="utf-8")}
    for i, (term, answer) in enumerate(kept):
        chat = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(t=term)},
                             {"role": "assistant", "content": answer}]}
        split = "eval" if i % EVAL_EVERY == EVAL_EVERY - 1 else "train"
        files[split].write(json.dumps(chat, ensure_ascii=False) + "\n")
    for f in files.values():
        f.close()
    print(f"{len(usable)} usable entries, {len(kept)} kept")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ".")
