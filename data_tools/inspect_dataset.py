"""Summarise a `.bin/.idx` dataset and print documents decoded.

    python data_tools/inspect_dataset.py data/mix_text_document
    python data_tools/inspect_dataset.py data/mix_text_document --tokenizer-model spm/t5.model \\
        --document 0 --document 42

Prints the format and dtype, counts of documents, sequences and tokens, length statistics and a
histogram of sequence lengths; with --tokenizer-model, the given documents as text.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from megatron.data.indexed_dataset import IMPLS, IndexedDataset


def histogram_lines(lengths: np.ndarray, bins: int, width: int = 40) -> List[str]:
    """A text histogram of `lengths` on log2-spaced bins."""
    if lengths.size == 0:
        return ["(no sequences)"]
    low, top = max(int(lengths.min()), 1), max(int(lengths.max()), 1)
    edges = np.unique(np.geomspace(low, top + 1, num=bins + 1).astype(np.int64))
    if int(lengths.min()) == 0:
        edges = np.concatenate([[0], edges])
    counts, _ = np.histogram(lengths, bins=edges)
    peak = max(int(counts.max()), 1)
    lines = []
    for lo, hi, count in zip(edges[:-1], edges[1:], counts):
        bar = "#" * int(round(width * count / peak))
        lines.append(f"  [{lo:>8}, {hi:>8})  {count:>10}  {bar}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="dataset path without .bin/.idx")
    p.add_argument("--data-impl", default="infer", choices=IMPLS)
    p.add_argument("--tokenizer-model", "--tokenizer-path", dest="tokenizer_model", default=None,
                   help="to decode with: SentencePiece model, CPM-2 vocab.txt, or a folder "
                        "holding one")
    p.add_argument("--document", type=int, action="append", default=[],
                   help="print this document decoded (repeatable; needs --tokenizer-model)")
    p.add_argument("--bins", type=int, default=12, help="histogram bins")
    args = p.parse_args(argv)
    if args.document and not args.tokenizer_model:
        p.error("--document needs --tokenizer-model to decode")
    try:
        ds = IndexedDataset(args.prefix, impl=args.data_impl)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    docs = np.diff(ds.document_indices)
    print(f"dataset     {args.prefix} ({ds.impl}, {ds.dtype})")
    print(f"documents   {ds.num_documents}")
    print(f"sequences   {len(ds)} ({docs.mean() if docs.size else 0:.2f} per document)")
    print(f"tokens      {ds.num_tokens}")
    if lengths.size:
        print(f"lengths     min {lengths.min()}  mean {lengths.mean():.1f}  median "
              f"{int(np.median(lengths))}  p99 {int(np.percentile(lengths, 99))}  max {lengths.max()}")
    print("sequence length histogram:")
    print("\n".join(histogram_lines(lengths, args.bins)))
    if args.document:
        from megatron.data.tokenizer import build_tokenizer, resolve_tokenizer

        try:
            tokenizer = build_tokenizer(resolve_tokenizer(args.tokenizer_model))
        except (ValueError, ImportError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for doc in args.document:
            try:
                sequences = ds.document(doc)
            except IndexError as e:
                print(f"error: --document {doc}: {e}", file=sys.stderr)
                return 1
            print(f"--- document {doc}: {len(sequences)} sequences, "
                  f"{sum(len(s) for s in sequences)} tokens")
            for seq in sequences:
                print(tokenizer.decode(seq.tolist(), skip_special_tokens=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
