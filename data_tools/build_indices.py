"""Prebuild the index caches of a training run offline, so that a large job starts in seconds.

    python data_tools/build_indices.py --data-path 0.7 data/zh_text_document 0.3 data/en_text_document \\
        --split 949,50,1 --tokenizer-model spm/t5.model --encoder-seq-length 512 \\
        --train-iters 300000 --global-batch-size 2048 --eval-interval 1000 --eval-iters 10 \\
        --data-cache-path /shared/cache

Give it the data flags of the training command (the others are not needed); it builds exactly the
caches training will look up, prints what it built, and checks one sample of each split.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.arguments import build_parser as training_parser
from megatron.cli import CommandLineParser, refuse
from megatron.data.datasets.builder import build_datasets, data_file_problems
from megatron.data.data_args import (
    DATA_PATH_FLAGS,
    add_data_args,
    check_data_args,
    data_config_from_args,
    sample_counts_from_args,
    storage_settings_from_args,
    tokenizer_spec_from_args,
)
from megatron.config.flag_checks import objective_flag_problems
from megatron.config.given_flags import given_dests, record_given
from megatron.data.storage.object_storage import ObjectStorage
from megatron.data.storage.paths import path_flag_problems
from megatron.data.datasets.t5_dataset import T5SpecialTokens
from megatron.data.tokenizers.tokenizer import build_tokenizer


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 built, 2 a command line or data that cannot run (every problem listed,
    one a line, before anything is built), 1 a failure while building."""
    parser = add_data_args(CommandLineParser(description=__doc__.split("\n\n")[0]))
    record_given(parser)  # a flag of another objective is refused, as the trainer does
    args, unknown = parser.parse_known_args(argv)
    # the training command's other flags are welcome (and ignored); flags it would refuse too
    # are refused here, named as the trainer names them
    _, _, problems = training_parser().parse_collecting(unknown)
    if unknown and not problems:
        print(f"note: ignoring flags that do not concern the data: {' '.join(unknown)}",
              file=sys.stderr)
    problems += check_data_args(args) + path_flag_problems(vars(args), DATA_PATH_FLAGS) + \
        objective_flag_problems(vars(args), given_dests(vars(args), {}))
    try:
        spec = tokenizer_spec_from_args(args)
    except ValueError as e:
        problems.append(str(e))
    storage = ObjectStorage(storage_settings_from_args(vars(args)))
    if args.data_path:  # opened as training opens them: a missing or truncated prefix is named
        problems += data_file_problems(args.data_path, args.data_impl, storage)
    if problems:
        refuse(problems, job=False)
    start = time.time()
    try:
        tokenizer = build_tokenizer(spec, extra_ids=args.vocab_extra_ids)
        tokens = T5SpecialTokens.from_tokenizer(tokenizer, whole_word=args.whole_word_masking)
        counts = sample_counts_from_args(args)
        datasets = build_datasets(data_config_from_args(args), tokens, counts, storage)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, dataset in datasets.items():
        if dataset is None:
            print(f"{name:5s}: no samples requested or an empty split", file=sys.stderr)
            continue
        dataset[0]  # one sample end to end: the caches are usable
        print(f"{name:5s}: {len(dataset)} samples", file=sys.stderr)
    print(f"index caches ready in {time.time() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
