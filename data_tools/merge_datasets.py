"""Concatenate `.bin/.idx` datasets into one in bounded memory (as Megatron-LM's merge_datasets.py).

    python data_tools/merge_datasets.py --input data/part_a_text_document data/part_b_text_document \\
        --output-prefix data/all_text_document
    python data_tools/merge_datasets.py --input data/parts/ --output-prefix data/all_text_document
    python data_tools/merge_datasets.py --input 'data/parts/shard-*_text_document' \\
        --output-prefix s3://bucket/corpus/all_text_document

`--input` takes dataset prefixes (local or s3://), a directory whose datasets are merged in name
order, or a glob of prefixes (quoted; matched against the `.idx` files, in name order). Every input
must have the same token dtype. The index arrays stream in chunks and the tokens are copied in
pieces (megatron/data/storage/merge.py), so memory does not grow with the corpus; inputs on
s3:// are read by ranged reads. The output appears only when complete: a local one is renamed
into place, an s3:// one is written to `--staging-dir` and uploaded (.bin, sidecar, then .idx).
A bad input (missing, truncated, corrupt, another dtype) is one message naming the file, exit 2;
Ctrl-C or SIGTERM exits 130; neither leaves anything under the output's names.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import CommandLineParser
from megatron.data.storage import object_storage
from megatron.data.storage.paths import path_flag_problems
from megatron.data.storage.indexed_dataset import dataset_exists
from megatron.data.storage.merge import MergeInputError, merge_streaming, open_inputs

_GLOB_CHARS = "*?["


def expand_prefixes(inputs: Sequence[str]) -> List[str]:
    """Dataset prefixes of --input: prefixes as given, a directory's datasets and a glob's
    matches (PATTERN.idx with a .bin beside it) in name order. s3:// names prefixes only.

    Raises:
        FileNotFoundError: an item names no dataset."""
    prefixes: List[str] = []
    for item in inputs:
        if object_storage.is_remote(item):
            prefixes.append(item)  # its files are looked up when it is opened
        elif os.path.isdir(item):
            found = sorted(
                os.path.join(item, name[:-4]) for name in os.listdir(item)
                if name.endswith(".idx") and dataset_exists(os.path.join(item, name[:-4]))
            )
            if not found:
                raise FileNotFoundError(f"--input {item}: no .bin/.idx pair in this directory")
            prefixes.extend(found)
        elif dataset_exists(item):
            prefixes.append(item)
        elif any(c in item for c in _GLOB_CHARS):
            found = sorted(p[:-4] for p in glob.glob(item + ".idx") if dataset_exists(p[:-4]))
            if not found:
                raise FileNotFoundError(f"--input {item}: the pattern matches no .bin/.idx pair")
            prefixes.extend(found)
        else:
            raise FileNotFoundError(f"--input {item}: {item}.bin and {item}.idx do not both exist")
    return prefixes


def _merge(inputs, storage):
    """The `run` of the s3:// upload: the merge into args.output_prefix (a local path)."""
    def run(args: argparse.Namespace) -> int:
        summary = merge_streaming(inputs, args.output_prefix, storage)
        print(f"merged {summary.inputs} datasets: {summary.documents} documents, "
              f"{summary.sequences} sequences, {summary.tokens} tokens -> "
              f"{args.output_prefix}.bin/.idx", file=sys.stderr)
        return 0
    return run


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+",
                   help="dataset prefixes (local or s3://), directories or globs of prefixes")
    p.add_argument("--output-prefix",
                   help="where the merged PREFIX.bin/.idx go; an s3://bucket/key prefix is "
                        "written locally, then uploaded (.bin before .idx)")
    p.add_argument("--staging-dir", default=None,
                   help="with an s3:// --output-prefix: the local folder the output is written "
                        "to before the upload (needs room for it; removed after). Default: "
                        "$XDG_CACHE_HOME or ~/.cache, then t5-pretrain/object-storage/staging")
    p.add_argument("--manifest-only", metavar="PREFIX", default=None,
                   help="merge nothing: write the manifest of the shard set PREFIX_text_document "
                        "(its PREFIX-iiiii-of-nnnnn shards beside it) instead")
    args = p.parse_args(argv)
    if args.manifest_only is not None:
        return _manifest_only(args.manifest_only)
    if not args.input or not args.output_prefix:
        p.error("--input and --output-prefix are required (or --manifest-only PREFIX)")
    problems = path_flag_problems(vars(args), {
        "input": ("--input", ("s3",)), "output_prefix": ("--output-prefix", ("s3",)),
        "staging_dir": ("--staging-dir", ())})
    if problems:
        p.error("; ".join(problems))
    storage = object_storage.ObjectStorage()
    try:
        inputs = open_inputs(expand_prefixes(args.input), storage)
    except (OSError, ValueError) as e:  # MergeInputError, FileNotFoundError, ObjectStorageError
        print(f"error: {e}; nothing was written", file=sys.stderr)
        return 2
    run = _merge(inputs, storage)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: temporaries removed
    try:
        if object_storage.is_remote(args.output_prefix):
            from megatron.data.preprocess.object_output import run_to_object_storage

            return run_to_object_storage(args, run, storage)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        return run(args)
    except MergeInputError as e:
        print(f"error: {e}; nothing was written", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: nothing was written to {args.output_prefix}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for item in inputs:
            item.close()


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
