"""Turn JSONL corpora into Megatron `.bin/.idx` datasets, with Megatron-LM's flags.

    python data_tools/preprocess_data.py --input corpus/*.jsonl.gz --output-prefix data/mix \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model spm/t5.model \\
        --append-eod --workers 8

writes `data/mix_text_document.{bin,idx}` (`_sentence` with `--split-sentences`), one pair per
`--json-keys` key. CPM-2's tokenizer instead: `--tokenizer-path bpe_cn` (a folder holding CPM-2's
vocab.txt), or `--tokenizer-type CPM2Tokenizer --vocab-file bpe_cn/vocab.txt` (needs jieba). What it does beyond Megatron's tool:
- one streaming pass: the main process reads chunks of whole lines, worker processes parse,
  split sentences (offline Punkt, see megatron/data/preprocess/sentence_splitter.py) and tokenize, the main
  process writes in input order; memory is bounded by the chunks in flight, not the input size;
- a progress bar (docs/s, MB/s, ETA) and a summary at the end;
- bad lines (invalid UTF-8 or JSON, not an object, a missing key, a non-string value, a lone
  surrogate escape, an empty document) are skipped and listed with file and line in
  `PREFIX_bad_lines.tsv`, or stop the run at the first one, in input order, with `--strict`;
- a UTF-8 byte order mark (BOM) that starts an input file (Windows tools write one) is removed
  and counted in the summary; one anywhere else makes its line bad;
- outputs appear under their names only when complete: a failed or interrupted run leaves none;
- beside each `.bin/.idx`, `PREFIX.meta.json` (megatron/data/storage/data_meta.py): the tokenizer, the
  EOD id, whether EOD was appended, the dtype and the counts, moved into place before the `.idx`.
  Training reads it instead of scanning the data for which documents end with EOD;
- `--output-prefix s3://bucket/key`: the destination is checked writable (a probe object put and
  deleted) before any work; the outputs are written to a local staging folder (`--staging-dir`),
  then uploaded, each `.bin` first and each `.idx` last;
- `--num-shards N --shard-index I` (or a Slurm array or srun step): this task writes shard I of N,
  `PREFIX-iiiii-of-nnnnn_...`, from its contiguous part of the input; the shard that completes
  the set writes its manifest (docs/data.md, "Preprocessing in shards").

The pipeline is megatron/data/preprocess/ (preprocess.py: one run; workers.py, pipeline.py,
sharding.py, manifest.py, object_output.py); this file holds the flags and what a shard adds.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import CommandLineParser
from megatron.data.storage.paths import path_flag_problems
from megatron.data.preprocess.manifest import ManifestError, write_manifest_if_complete
from megatron.data.preprocess.preprocess import run
from megatron.data.preprocess.sharding import ShardFlagError, shard_from_env, shard_prefix
from megatron.data.tokenizers.tokenizer import TOKENIZER_TYPES, resolve_tokenizer


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = CommandLineParser(
        description="Tokenize JSONL corpora into Megatron .bin/.idx datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True,
                   help="JSONL files (.jsonl, .json, .jsonl.gz), globs allowed, several allowed")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each line; one output dataset per key")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (output *_sentence); offline Punkt for English, "
                        "sentence-final punctuation for Chinese and Japanese")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences, keep the newlines between sentences")
    g.add_argument("--punkt-params", default=None,
                   help="Punkt parameters (JSON from data_tools/train_punkt.py); default: the ones "
                        "shipped with the package")
    g.add_argument("--lang", default="english",
                   help="language of the Punkt parameters (only 'english' is shipped; give "
                        "--punkt-params for others)")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="default: from the file (a CPM-2 vocab.txt: CPM2Tokenizer, else "
                        "SentencePieceTokenizer)")
    g.add_argument("--tokenizer-model", "--tokenizer-path", dest="tokenizer_model",
                   help="SentencePiece model file, CPM-2 vocab.txt, or a folder holding one "
                        "(CPM-2's bpe_cn)")
    g.add_argument("--vocab-file", default=None,
                   help="CPM-2 vocab.txt (with --tokenizer-type CPM2Tokenizer, as Megatron "
                        "spells it)")
    g.add_argument("--vocab-extra-ids", type=int, default=100,
                   help="T5 sentinels <extra_id_i> appended after the SentencePiece pieces (a "
                        "CPM-2 vocabulary has its own <s_i>)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document id (T5: EOS; CPM-2: <eod>) to each document")

    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{key}_{document|sentence}.bin/.idx; an s3://bucket/key "
                        "prefix is written locally, then uploaded (.bin before .idx)")
    g.add_argument("--staging-dir", default=None,
                   help="with an s3:// --output-prefix: the local folder the outputs are written "
                        "to before the upload (needs room for them; removed after). Default: "
                        "$XDG_CACHE_HOME or ~/.cache, then t5-pretrain/object-storage/staging")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                   help="only Megatron's mmap format is written (legacy formats are read-only)")

    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)),
                   help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1,
                   help="accepted for Megatron compatibility; streaming makes partitions "
                        "unnecessary, so the output is the same for any value")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted for Megatron compatibility: documents always keep input order")
    g.add_argument("--num-shards", type=int, default=None,
                   help="write shard --shard-index of this many (PREFIX-iiiii-of-nnnnn_...): the "
                        "input cut into contiguous parts balanced by bytes; default: from a "
                        "Slurm array or srun step, else one unsharded output")
    g.add_argument("--shard-index", type=int, default=None,
                   help="which shard (0-based) with --num-shards; default: from "
                        "SLURM_ARRAY_TASK_ID or SLURM_PROCID")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress lines when stderr is not a terminal")
    g.add_argument("--chunk-mb", type=float, default=1.0,
                   help="MB of input lines handed to a worker at a time")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first bad line instead of skipping and reporting it")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    problems = []
    if args.workers < 1:
        problems.append("--workers must be at least 1")
    if args.partitions < 1:
        problems.append("--partitions must be at least 1")
    if args.log_interval < 1:
        problems.append("--log-interval must be at least 1")
    if args.chunk_mb <= 0:
        problems.append("--chunk-mb must be positive")
    if args.keep_newlines and not args.split_sentences:
        problems.append("--keep-newlines only has an effect with --split-sentences")
    if args.lang != "english" and args.split_sentences and not args.punkt_params:
        problems.append(f"--lang {args.lang}: no shipped Punkt parameters; train them with "
                        "data_tools/train_punkt.py and pass --punkt-params")
    try:
        args.shard = shard_from_env(args.num_shards, args.shard_index, os.environ)
    except ShardFlagError as e:
        problems.append(str(e))
    if len(set(args.json_keys)) != len(args.json_keys):
        problems.append("--json-keys has a key twice")
    try:
        args.tokenizer = resolve_tokenizer(args.tokenizer_model, args.tokenizer_type,
                                           args.vocab_file)
    except ValueError as e:
        problems.append(str(e))
    problems += path_flag_problems(vars(args), {  # s3:// for the output only
        "input": ("--input", ()), "punkt_params": ("--punkt-params", ()),
        "tokenizer_model": ("--tokenizer-model", ()), "vocab_file": ("--vocab-file", ()),
        "output_prefix": ("--output-prefix", ("s3",)), "staging_dir": ("--staging-dir", ())})
    if args.punkt_params and not os.path.isfile(args.punkt_params):
        problems.append(f"--punkt-params {args.punkt_params}: no such file")
    if problems:
        p.error("; ".join(problems))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    set_prefix = args.output_prefix
    if args.shard is not None:
        args.output_prefix = shard_prefix(set_prefix, args.shard.index, args.shard.count)
    if str(args.output_prefix).startswith("s3://"):
        from megatron.data.preprocess.object_output import run_to_object_storage

        code = run_to_object_storage(args, run)
    else:
        code = run(args)
    if code == 0 and args.shard is not None:
        return _manifest_if_complete(args, set_prefix)
    return code


def _manifest_if_complete(args: argparse.Namespace, set_prefix: str) -> int:
    """Write the set's manifests if this shard completed it (megatron/data/preprocess/manifest)."""
    level = "sentence" if args.split_sentences else "document"
    for key in args.json_keys:
        try:
            path = write_manifest_if_complete(set_prefix, f"_{key}_{level}", args.shard.count)
        except (ManifestError, OSError, ValueError) as e:
            print(f"error: this shard is written, but the set's manifest is not: {e}",
                  file=sys.stderr)
            return 1
        if path is not None:
            print(f"the set is complete: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
