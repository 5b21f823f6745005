"""Write rolling_test.jsonl (the perplexity task's documents) from ../corpora (README.md of this
folder): `python tests/data/eval_tasks/make_rolling.py` rewrites it identically."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPORA = HERE.parent / "corpora"
TAKE = (  # (corpus, documents, characters at most per document)
    ("en_wikitext2.jsonl", 3, 700),
    ("en_shakespeare.jsonl", 4, 500),
    ("zh_cmrc2019_stories.jsonl", 3, 300),
)


def excerpt(text: str, limit: int) -> str:
    """The first lines of `text` that fit in `limit` characters (at least one line, cut)."""
    out = ""
    for line in text.splitlines(keepends=True):
        if len(out) + len(line) > limit:
            break
        out += line
    return out or text[:limit]


def main() -> None:
    with open(HERE / "rolling_test.jsonl", "w", encoding="utf-8") as f:
        for name, count, limit in TAKE:
            with open(CORPORA / name, encoding="utf-8") as src:
                for _, line in zip(range(count), src):
                    text = excerpt(json.loads(line)["text"], limit)
                    f.write(json.dumps({"text": text, "source": name}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
