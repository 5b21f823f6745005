"""The tokenizer a checkpoint conversion (data_tools/convert_checkpoint.py) carries: the run's
own (--tokenizer-model, else the one its meta.json's flags name), and CPM-2's vocabulary files
where a Hugging Face export stands in for a SentencePiece tokenizer with them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


def tokenizer_of(args, source_folder: Optional[Path]):
    """The run's tokenizer as a TokenizerSpec (megatron/data/tokenizers/tokenizer.py): --tokenizer-model,
    else the flags the run recorded in the iteration folder `source_folder`'s meta.json (its
    tokenizer file and type); None when unknown or gone."""
    from megatron.checkpoint.formats.meta import read_meta
    from megatron.data.tokenizers.tokenizer import resolve_tokenizer

    path, kind = args.tokenizer_model, None
    if path is None and source_folder is not None:
        try:
            flags = read_meta(source_folder)["flags"]
        except (ValueError, KeyError):  # (CheckpointReadError is a ValueError)
            return None
        path, kind = flags.get("tokenizer_model"), flags.get("tokenizer_type")
        if not path or not Path(path).exists():
            return None
    if path is None:
        return None
    try:
        return resolve_tokenizer(path, kind)
    except ValueError as e:
        print(f"warning: {e}", file=sys.stderr)
        return None


def cpm2_vocab_export(config, spec, source: dict):
    """A run of ours trained with CPM-2's tokenizer: (config with the vocabulary's special ids,
    the vocab.txt + README that stand in for a SentencePiece tokenizer in the folder)."""
    from megatron.checkpoint.formats.cpm2 import CPM2TokenizerFiles, read_vocab, with_special_ids

    vocab = Path(spec.path)
    config = with_special_ids(config, read_vocab(vocab), vocab, exact=False)
    return config, CPM2TokenizerFiles(config, Path(spec.path), f"{source['path']} (trained "
                                      f"here with CPM-2's tokenizer)")


def cpm2_tokenizer_files(args, config, source: dict):
    """vocab.txt (when given) and the README naming CPM-2's tokenizer, for --to hf."""
    from megatron.checkpoint.formats.cpm2 import CPM2TokenizerFiles, vocab_file

    vocab = vocab_file(args.vocab) if args.vocab is not None else None
    if vocab is None:
        print("warning: no vocab.txt (give --tokenizer-path, CPM-2's bpe_cn/ or bpe_cn_en/): the "
              "folder has weights, config and a README only, and its special ids are bpe_cn's",
              file=sys.stderr)
    where = f"{source['path']} (iteration {source['iteration']}, model-parallel size " \
        f"{source['model_parallel_size']})"
    return CPM2TokenizerFiles(config, vocab, where)
