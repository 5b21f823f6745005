"""Write cloze_train.jsonl and cloze_valid.jsonl from tests/data/corpora/en_shakespeare.jsonl
(README.md of this folder): `python tests/data/finetune/make_cloze.py`."""

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpora" / "en_shakespeare.jsonl"
TRAIN, VALID = 64, 16


def examples():
    """Spoken lines of 5 to 12 words, in corpus order: the first of its longest words becomes
    ___ in the input and is the target."""
    with open(CORPUS, encoding="utf-8") as f:
        for doc in f:
            for line in json.loads(doc)["text"].split("\n"):
                words = line.split()
                if not 5 <= len(words) <= 12 or line.endswith(":"):
                    continue
                clean = [re.sub(r"[^A-Za-z]", "", w) for w in words]
                k = max(range(len(words)), key=lambda i: (len(clean[i]), -i))
                if len(clean[k]) < 4 or clean[k] != words[k].strip(",.;:!?"):
                    continue
                words[k] = words[k].replace(clean[k], "___")
                yield {"input": " ".join(words), "target": clean[k]}


def main() -> None:
    rows = []
    for row in examples():
        rows.append(row)
        if len(rows) == TRAIN + VALID:
            break
    for name, part in (("cloze_train.jsonl", rows[:TRAIN]), ("cloze_valid.jsonl", rows[TRAIN:])):
        with open(HERE / name, "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
