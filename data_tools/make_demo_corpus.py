"""Write the embedded demo corpus: the Python standard library's help topics as JSONL.

Every Python installation carries this text (`pydoc_data.topics`), so the quickstart runs on a
fresh machine with no network. One document per topic, `{"text": ...}` per line.

    python data_tools/make_demo_corpus.py --output demo/corpus.jsonl
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import CommandLineParser  # noqa: E402 - after the path is set
from megatron.data.storage.paths import scheme_problems  # noqa: E402


def demo_documents():
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    if scheme_problems("--output", args.output):
        p.error(scheme_problems("--output", args.output)[0])
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = f"{args.output}.tmp-{os.getpid()}"
    count = size = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for text in demo_documents():
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            count += 1
            size += len(line.encode("utf-8"))
    os.replace(tmp, args.output)
    print(f"wrote {count} documents ({size / 1e6:.2f} MB) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
