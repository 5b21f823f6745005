"""Concatenate `.bin/.idx` datasets into one (Megatron-LM's tools/merge_datasets.py, checked).

    python data_tools/merge_datasets.py --input data/part_a_text_document data/part_b_text_document \\
        --output-prefix data/all_text_document
    python data_tools/merge_datasets.py --input data/parts/ --output-prefix data/all_text_document

`--input` takes dataset prefixes, or a directory whose datasets are merged in name order. Every
input must have the same token dtype; the output appears only when complete.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import CommandLineParser
from megatron.data.storage.paths import scheme_problems
from megatron.data.storage.indexed_dataset import IndexedDataset, dataset_exists, merge_datasets


def expand_prefixes(inputs: Sequence[str]) -> List[str]:
    prefixes: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, name[:-4]) for name in os.listdir(item)
                if name.endswith(".idx") and dataset_exists(os.path.join(item, name[:-4]))
            )
            if not found:
                raise FileNotFoundError(f"--input {item}: no .bin/.idx pair in this directory")
            prefixes.extend(found)
        elif dataset_exists(item):
            prefixes.append(item)
        else:
            raise FileNotFoundError(f"--input {item}: {item}.bin and {item}.idx do not both exist")
    return prefixes


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", help="dataset prefixes or directories")
    p.add_argument("--output-prefix")
    p.add_argument("--manifest-only", metavar="PREFIX", default=None,
                   help="merge nothing: write the manifest of the shard set PREFIX_text_document "
                        "(its PREFIX-iiiii-of-nnnnn shards beside it) instead")
    args = p.parse_args(argv)
    if args.manifest_only is not None:
        return _manifest_only(args.manifest_only)
    if not args.input or not args.output_prefix:
        p.error("--input and --output-prefix are required (or --manifest-only PREFIX)")
    problems = scheme_problems("--input", args.input) + \
        scheme_problems("--output-prefix", args.output_prefix)  # local files only
    if problems:
        p.error("; ".join(problems))
    try:
        prefixes = expand_prefixes(args.input)
        dtypes = {prefix: IndexedDataset(prefix, impl="infer").dtype for prefix in prefixes}
        if len(set(dtypes.values())) > 1:
            listing = ", ".join(f"{k} ({v})" for k, v in dtypes.items())
            raise ValueError(f"token dtypes differ, cannot merge: {listing}")
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        merged = merge_datasets(prefixes, args.output_prefix)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets: {merged.num_documents} documents, {len(merged)} "
          f"sequences, {merged.num_tokens} tokens -> {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


def _manifest_only(prefix: str) -> int:
    from megatron.data.preprocess.manifest import ManifestError, write_manifest_of_set

    try:
        print(f"wrote {write_manifest_of_set(prefix)}", file=sys.stderr)
    except (ManifestError, OSError) as e:
        print(f"error: --manifest-only {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
