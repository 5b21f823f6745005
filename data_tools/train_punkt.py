"""Train Punkt sentence-splitting parameters offline and save them as JSON.

    python data_tools/train_punkt.py --input corpus/*.jsonl --output punkt_mylang.json

Pass the result to `preprocess_data.py --split-sentences --punkt-params punkt_mylang.json`.
Punkt is unsupervised: plain text of the target language is all it needs, and nothing is
downloaded. The package's own `megatron/data/preprocess/assets/punkt_english.json` was made with

    python data_tools/train_punkt.py --pydoc-topics --english-abbreviations \\
        --input tests/data/corpora/en_shakespeare.jsonl \\
        --output megatron/data/preprocess/assets/punkt_english.json
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterator, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import CommandLineParser
from megatron.data.storage.paths import scheme_problems
from megatron.data.preprocess.jsonl import BadLine, expand_inputs, iter_texts
from megatron.data.preprocess.sentence_splitter import save_punkt_parameters, train_punkt_parameters


# Common English abbreviations that small training texts rarely teach Punkt (lower case, without the
# final period, as Punkt stores them).
ENGLISH_ABBREVIATIONS = (
    "mr mrs ms dr prof sr jr st mt ft gen col lt sgt capt rev hon gov sen rep pres "
    "e.g i.e etc vs cf al approx dept est fig no nos vol vols ch sec pp ed eds "
    "inc ltd co corp bros u.s u.k u.n a.m p.m jan feb mar apr jun jul aug sep sept oct nov dec"
).split()


def pydoc_topic_texts() -> Iterator[str]:
    """The standard library's help topics: English prose that every Python installation has."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="*", default=[], help="JSONL files or globs")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--pydoc-topics", action="store_true",
                   help="also train on the Python standard library's help topics")
    p.add_argument("--english-abbreviations", action="store_true",
                   help="add a built-in list of common English abbreviations (Mr., e.g., ...)")
    p.add_argument("--max-mb", type=float, default=200.0, help="stop after this much text")
    p.add_argument("--output", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    problems = scheme_problems("--input", args.input) + scheme_problems("--output", args.output)
    if problems:
        p.error("; ".join(problems))
    if not args.input and not args.pydoc_topics:
        p.error("give --input and/or --pydoc-topics")
    try:
        paths = expand_inputs(args.input)
    except FileNotFoundError as e:
        p.error(str(e))

    budget = int(args.max_mb * 1e6)
    used = {"chars": 0, "bad": 0}

    def texts() -> Iterator[str]:
        sources = [pydoc_topic_texts()] if args.pydoc_topics else []
        for source in sources:
            for text in source:
                used["chars"] += len(text)
                yield text
        for path, line, item in iter_texts(paths, args.json_keys):
            if isinstance(item, BadLine):
                used["bad"] += 1
                continue
            for text in item:
                if used["chars"] >= budget:
                    return
                used["chars"] += len(text)
                yield text

    start = time.time()
    params = train_punkt_parameters(texts())
    if args.english_abbreviations:
        params.abbrev_types.update(ENGLISH_ABBREVIATIONS)
    save_punkt_parameters(params, args.output)
    print(f"trained on {used['chars'] / 1e6:.1f} M characters in {time.time() - start:.1f} s "
          f"({used['bad']} bad lines skipped): {len(params.abbrev_types)} abbreviations, "
          f"{len(params.collocations)} collocations, {len(params.sent_starters)} sentence "
          f"starters -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
