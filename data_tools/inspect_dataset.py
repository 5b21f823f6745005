"""Summarise a `.bin/.idx` dataset and print documents decoded.

    python data_tools/inspect_dataset.py data/mix_text_document
    python data_tools/inspect_dataset.py data/mix_text_document --tokenizer-model spm/t5.model \\
        --document 0 --document 42

Prints the format and dtype, counts of documents, sequences and tokens, length statistics and a
histogram of sequence lengths; with --tokenizer-model, the given documents as text.

    python data_tools/inspect_dataset.py data/mix_text_document --tokenizer-model spm/t5.model \
        --t5-objective ul2 --samples 5 [--json] [the trainer's data and schedule flags]

prints the first N training samples as the trainer builds them (the same --encoder-seq-length,
--decoder-seq-length, --seed, --split, objective flags and, for the same sample order, the same
--train-iters and --global-batch-size), decoded; with --json one JSON object per sample on
stdout and nothing else there: denoiser_kind ("R", "S", "X"; T5's span corruption is "R"),
mean_span and corruption_rate (null where they do not apply), encoder_input_ids, labels and
decoder_input_ids without padding. A prefix may be s3://bucket/key. The index caches it builds
go to a temporary folder, removed at exit, unless --data-cache-path names one (an inspection
writes nothing beside the data). A prefix may name a shard set (preprocess_data.py --num-shards:
its `.shards.json` manifest): it is read as the merged file would be.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from megatron.cli import CommandLineParser
from megatron.data.storage.paths import path_flag_problems
from megatron.data.storage.indexed_dataset import IMPLS
from megatron.data.storage.shard_set import ShardSetError, open_dataset


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


def print_samples(args, rest: Sequence[str]) -> int:
    """--samples N: the first N training samples as the trainer builds them (module docstring)."""
    from megatron.data.data_args import add_data_args, storage_settings_from_args
    from megatron.data.storage.object_storage import ObjectStorage

    parser = add_data_args(CommandLineParser(prog="inspect_dataset.py --samples"),
                           schedule=False)
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    flags = parser.parse_args(["--data-path", args.prefix, "--tokenizer-model",
                               args.tokenizer_model, *rest])
    flags.train_iters = flags.train_iters or args.samples
    flags.global_batch_size = flags.global_batch_size or 1
    flags.eval_interval, flags.eval_iters = 0, 0
    # the index copies of s3:// data where the trainer's go (not in the temporary folder below)
    storage = ObjectStorage(storage_settings_from_args(vars(flags)))
    if flags.data_cache_path is not None:
        return _print_samples(args, flags, storage)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="inspect-dataset-") as cache:
        flags.data_cache_path = cache  # nothing left beside the user's data
        return _print_samples(args, flags, storage)


def _print_samples(args, flags, storage) -> int:
    import json

    from megatron.data.datasets.builder import build_datasets
    from megatron.data.data_args import (
        check_data_args,
        data_config_from_args,
        tokenizer_spec_from_args,
    )
    from megatron.data.datasets.megatron_t5_dataset import MegatronUL2Dataset
    from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5SpecialTokens, UL2Dataset
    from megatron.data.tokenizers.tokenizer import build_tokenizer
    from megatron.data.datasets.ul2 import describe_sample

    out = sys.stdout
    if args.json:  # stdout carries the samples alone
        sys.stdout = sys.stderr
    try:
        problems = check_data_args(flags)
        if problems:
            print("error: " + "; ".join(problems), file=sys.stderr)
            return 2
        config = data_config_from_args(flags)
        tokenizer = build_tokenizer(tokenizer_spec_from_args(flags),  # the trainer's
                                    extra_ids=flags.vocab_extra_ids)
        tokens = T5SpecialTokens.from_tokenizer(tokenizer, whole_word=config.t5.whole_word)
        count = flags.train_iters * flags.global_batch_size
        dataset = build_datasets(config, tokens, (count, 0, 0), storage)["train"]
    except (OSError, ValueError) as e:  # a missing or bad dataset, settings it refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout = out
    if dataset is None:
        print("error: no training samples (check --split)", file=sys.stderr)
        return 1
    for index in range(min(args.samples, len(dataset))):
        sample = dataset[index]
        enc = sample["encoder_input_ids"][sample["encoder_attention_mask"] == 1].tolist()
        labels = sample["labels"][sample["labels"] != IGNORE_INDEX].tolist()
        dec = sample["decoder_input_ids"][sample["decoder_attention_mask"] == 1].tolist()
        if isinstance(dataset, (UL2Dataset, MegatronUL2Dataset)):
            info = describe_sample(config.t5.ul2, dataset.denoised(index)[0])
        elif config.objective == "span-corruption":
            info = {"denoiser_kind": "R", "mean_span": config.t5.mean_noise_span_length,
                    "corruption_rate": config.t5.noise_density}
        else:
            info = {"denoiser_kind": None, "mean_span": None, "corruption_rate": None}
        if args.json:
            print(json.dumps({"index": index, **info, "encoder_input_ids": enc,
                              "labels": labels, "decoder_input_ids": dec}))
            continue
        what = ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
        print(f"--- sample {index} ({what}): {len(enc)} input, {len(labels)} target tokens")
        print("input:  " + tokenizer.decode(enc, skip_special_tokens=False))
        print("target: " + tokenizer.decode(labels, skip_special_tokens=False))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = CommandLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="dataset path without .bin/.idx")
    p.add_argument("--data-impl", default="infer", choices=IMPLS)
    p.add_argument("--tokenizer-model", "--tokenizer-path", dest="tokenizer_model", default=None,
                   help="to decode with: SentencePiece model, CPM-2 vocab.txt, or a folder "
                        "holding one")
    p.add_argument("--document", type=int, action="append", default=[],
                   help="print this document decoded (repeatable; needs --tokenizer-model)")
    p.add_argument("--bins", type=int, default=12, help="histogram bins")
    p.add_argument("--samples", type=int, default=0,
                   help="print the first N training samples as the trainer builds them (needs "
                        "--tokenizer-model; takes the trainer's data and schedule flags)")
    p.add_argument("--json", action="store_true",
                   help="with --samples: one JSON object per sample on stdout, nothing else")
    args, rest = p.parse_known_args(argv)
    if rest and not args.samples:
        p.refuse_unknown(rest)
    problems = path_flag_problems(vars(args), {"prefix": ("PREFIX", ("s3",)),
                                               "tokenizer_model": ("--tokenizer-model", ())})
    if problems:
        p.error("; ".join(problems))
    if (args.document or args.samples) and not args.tokenizer_model:
        p.error("--document and --samples need --tokenizer-model")
    if args.samples:
        return print_samples(args, rest)
    try:
        ds = open_dataset(args.prefix, impl=args.data_impl)  # a file, or a shard set
    except ShardSetError as e:  # a missing shard, an unreadable manifest: the input is refused
        print(f"error: {e}", file=sys.stderr)
        return 2
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
        from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer

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
