"""CPM-2 checkpoints (CPM-2-Pretrain, CPM-2-Finetune) as full tensors under our names, and the
CPM-2 parts of a Hugging Face export (its vocab.txt and a README naming the tokenizer).

The one reader of either kind, dense (CPM-2-Pretrain, CPM-2-Finetune) or Mixture-of-Experts
(CPM-2-MoE, cpm2_moe.py): `read_cpm2_checkpoint`. What CPM-2's save writes, and how its
model-parallel ranks hold each tensor: cpm2_shards.py.

Their model against ours (megatron/model/transformer.py), read in their code:
- The same: RMS norm with weight only and fp32 variance; no 1/sqrt(d_kv) score scaling; bias-free
  linears; T5's relative position buckets (bidirectional in the encoder, causal in the decoder,
  the bias of block 0 reused by the stack, none in cross-attention); gated tanh-GELU
  (0.5 x (1 + tanh(0.79788456 (x + 0.044715 x^3))) = gelu_new); pre-norm residual blocks; final
  norm then dropout; no scaling of the embeddings.
- Different, and given to our model through T5Config: an untied lm_head and no d_model ** -0.5
  before it (tie_word_embeddings and scale_decoder_outputs false); gated GELU whatever their
  config's feed_forward_proj says (their xlarge config says 'relu'); the decoder has num_layers
  blocks (their num_decoder_layers is never read); max_distance fixed at 128.
- Different without effect on the weights: masked scores get -10000 (ours the float minimum;
  the same probabilities unless a row is all masked); training applies dropout twice to the
  attention output; the encoder mask comes from the caller (CPM-2 attends to padding).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint.formats.cpm2_moe import CPM2MoECheckpoint, dense_config, is_cpm2_moe
from megatron.checkpoint.formats.cpm2_shards import CPM2Checkpoint, PathLike, find_iteration
from megatron.model.config import ConfigError, T5Config

MAX_DISTANCE = 128  # their _relative_position_bucket's default; compute_bias never passes one
CPM2_KEYS = {"d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
             "relative_attention_num_buckets", "dropout_rate", "layer_norm_epsilon",
             "initializer_factor", "feed_forward_proj", "use_cache",
             "use_scaled_init_for_output_weights", "init_method_std", "max_position_embeddings",
             "do_dim_trick", "attn_scale", "output_attention"}
"""EncDecConfig's keys (their src/model/configuration_enc_dec.py; output_attention and attn_scale
from CPM-2-Finetune's). Taken: the sizes, dropout, epsilon, init; checked: do_dim_trick and
attn_scale off; ignored (not read by their model): the rest."""
SPECIALS = {"decoder_start_token_id": "<s>", "pad_token_id": "<pad>", "eos_token_id": "<eod>"}
"""CPM-2-Finetune's targets start with '<s> <s_0>'; '<pad>' pads; '<eod>' ends a document."""
DEFAULT_IDS = {"decoder_start_token_id": 1, "pad_token_id": 5, "eos_token_id": 7}
"""bpe_cn/vocab.txt's ids (bpe_cn_en has '<eod>' at 8): used when no vocab.txt is given."""



def read_cpm2_checkpoint(root: PathLike, model_config: PathLike,
                         iteration: Optional[int] = None, vocab: Optional[PathLike] = None
                         ) -> Tuple[T5Config, Iterator[Tuple[str, torch.Tensor]], Dict[str, Any],
                                    List[str]]:
    """A CPM-2 checkpoint, dense or CPM-2-MoE, as (config, (our name, full tensor) one at a time
    in our model's order, a description of the source, notes worth a warning). Everything is
    checked before the iterator is returned: the files, every rank's names and shapes against
    the config, the vocabulary (and for CPM-2-MoE the centroids, the number of experts).

    Args:
        root: the --save folder (or an iteration folder).
        model_config: the run's --model-config (CPM-2's JSON or ours; see `read_config`).
        iteration: default the tracker's.
        vocab: vocab.txt (or its folder): its size is checked, the special ids taken from it.

    Raises:
        CheckpointReadError, ConfigError: one message naming the file (and the tensor).
    """
    folder = find_iteration(Path(root), iteration)
    moe = CPM2MoECheckpoint(folder) if is_cpm2_moe(folder) else None
    checkpoint = moe or CPM2Checkpoint.open(root, iteration)
    config, notes = read_config(model_config, checkpoint.vocab_rows())
    if moe is not None:
        moe.check_config(config, str(model_config))
        config = dense_config(config)  # the dense reader's names; the experts stacked after
    if vocab is not None:
        path = vocab_file(vocab)
        config = with_special_ids(config, read_vocab(path), path)
    checkpoint.check(config, str(model_config))
    source = {"format": "cpm2", "path": str(checkpoint.folder.resolve()),
              "iteration": checkpoint.iteration}
    if moe is None:
        source.update(model_parallel_size=checkpoint.size,
                      model_config=str(Path(model_config).resolve()))
        return config, checkpoint.tensors(config), source, notes
    notes += moe.notes()
    source.update(model_parallel_size=moe.model_parallel_size, cpm2_layout=moe.layout,
                  num_experts=moe.num_experts, model_config=str(Path(model_config).resolve()))
    return moe.sparse_config(config, str(model_config)), moe.tensors(config), source, notes


# The config --------------------------------------------------------------------------------------
def read_config(path: PathLike, vocab_size: int) -> Tuple[T5Config, List[str]]:
    """The T5Config of a CPM-2 model: (config, notes worth a warning).

    `path` is CPM-2's own model config (their enc_dec_*_config.json: no vocab_size, which comes
    from the checkpoint) or ours / a Hugging Face config.json (with vocab_size), which must then
    describe CPM-2's architecture.

    Raises:
        ConfigError: unknown keys, values CPM-2's code does not build, or ours contradicting
            CPM-2's architecture (each named).
    """
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read model config {path}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    if "vocab_size" in values:
        return _our_config(values, path, vocab_size), []
    return _their_config(values, path, vocab_size)


def _their_config(values: Dict[str, Any], path: Path, vocab_size: int
                  ) -> Tuple[T5Config, List[str]]:
    unknown = sorted(set(values) - CPM2_KEYS)
    if unknown:
        raise ConfigError(f"{path}: keys that CPM-2's EncDecConfig does not have: "
                          f"{', '.join(unknown)} (a config of ours needs vocab_size)")
    problems = [f"{key} {values[key]!r} is not supported (only false)"
                for key in ("do_dim_trick", "attn_scale") if values.get(key, False) is not False]
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    notes = []
    if values.get("feed_forward_proj", "gated-gelu") != "gated-gelu":
        notes.append(f"{path}: feed_forward_proj {values['feed_forward_proj']!r} is not read by "
                     f"CPM-2's code, which always builds gated GELU; converting as gated-gelu")
    layers = values.get("num_layers", 12)
    if values.get("num_decoder_layers", layers) != layers:
        notes.append(f"{path}: num_decoder_layers {values['num_decoder_layers']} is not read by "
                     f"CPM-2's code, whose decoder has num_layers ({layers}) blocks")
    fields = {k: values[k] for k in ("d_model", "d_kv", "d_ff", "num_heads",
                                     "relative_attention_num_buckets", "dropout_rate",
                                     "layer_norm_epsilon", "initializer_factor",
                                     "init_method_std", "use_scaled_init_for_output_weights")
              if k in values}
    defaults = {"d_model": 768, "d_kv": 64, "d_ff": 256, "num_heads": 12}  # EncDecConfig's
    fields = {**defaults, **fields}
    try:
        config = T5Config(vocab_size=vocab_size, num_layers=layers, num_decoder_layers=layers,
                          relative_attention_max_distance=MAX_DISTANCE,
                          feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                          scale_decoder_outputs=False, init_method="cpm2", **DEFAULT_IDS,
                          **fields)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return config, notes


def _our_config(values: Dict[str, Any], path: Path, vocab_size: int) -> T5Config:
    config = T5Config.from_dict(values, source=str(path))
    problems = []
    expect = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
              "scale_decoder_outputs": False,
              "relative_attention_max_distance": MAX_DISTANCE, "vocab_size": vocab_size,
              "num_decoder_layers": config.num_layers}
    for key, value in expect.items():
        if getattr(config, key) != value:
            problems.append(f"{key} is {getattr(config, key)!r}, CPM-2's model has {value!r}")
    if problems:
        raise ConfigError(f"{path}: not CPM-2's architecture: " + "; ".join(problems) +
                          " (the vocabulary size is the checkpoint's; or give CPM-2's own "
                          "model config)")
    return config


# The vocabulary and the Hugging Face export ------------------------------------------------------
def vocab_file(path: PathLike) -> Path:
    """vocab.txt: `path` itself, or the file in the folder `path` (CPM-2's --tokenizer-path).

    Raises:
        ConfigError: neither exists.
    """
    path = Path(path)
    found = path / "vocab.txt" if path.is_dir() else path
    if not found.is_file():
        raise ConfigError(f"{found}: no such vocabulary file (give CPM-2's vocab.txt or the "
                          f"folder holding it)")
    return found


def read_vocab(path: Path) -> List[str]:
    """The tokens, id = line number from 0, as CPM-2's load_vocab reads them (each line
    stripped; lines split at '\\n' only)."""
    with open(path, encoding="utf-8") as f:  # universal newlines, as their readline()
        lines = f.read().split("\n")
    if lines[-1] == "":  # the newline ending the last line
        lines.pop()
    return [line.strip() for line in lines]


def with_special_ids(config: T5Config, tokens: List[str], path: Path,
                     exact: bool = True) -> T5Config:
    """`config` with the decoder start, pad and eos ids of the vocabulary.

    exact: the vocabulary must have the model's size (a CPM-2 checkpoint); else (a run of ours
        trained with CPM-2's tokenizer) it may be smaller than the embedding.
    Raises:
        ConfigError: its size does not fit the checkpoint's, or a special token is missing.
    """
    if len(tokens) > config.vocab_size or (exact and len(tokens) != config.vocab_size):
        raise ConfigError(f"{path}: {len(tokens)} tokens, the checkpoint's vocabulary has "
                          f"{config.vocab_size} rows: not this model's vocab.txt")
    index = {t: i for i, t in enumerate(tokens)}
    missing = [t for t in SPECIALS.values() if t not in index]
    if missing:
        raise ConfigError(f"{path}: no {', '.join(missing)}: not a CPM-2 vocabulary")
    return dataclasses.replace(config, **{k: index[t] for k, t in SPECIALS.items()})


class CPM2TokenizerFiles:
    """What a CPM-2 model's Hugging Face folder carries for its tokenizer (write_hf_folder's
    tokenizer_files): vocab.txt when known, and a README.md saying how to tokenize."""

    def __init__(self, config: T5Config, vocab: Optional[Path], source: str) -> None:
        self.vocab, self.source, self.config = vocab, source, config
        self.vocab_size = config.vocab_size
        self.sentinels = []
        if vocab is not None:
            tokens = read_vocab(vocab)
            self.sentinels = [(t, i) for i, t in enumerate(tokens) if re.fullmatch(r"<s_\d+>", t)]

    def write(self, folder: Path) -> None:
        if self.vocab is not None:
            shutil.copyfile(self.vocab, folder / "vocab.txt")
        (folder / "README.md").write_text(self.readme(), encoding="utf-8")

    def readme(self) -> str:
        c = self.config
        sentinels = (f"`{self.sentinels[0][0]}` = {self.sentinels[0][1]} ... "
                     f"`{self.sentinels[-1][0]}` = {self.sentinels[-1][1]}"
                     if self.sentinels else "see vocab.txt")
        vocab = ("`vocab.txt` here is the model's vocabulary: one token per line, the id is the "
                 "line number counted from 0." if self.vocab is not None else
                 "The conversion was given no vocab.txt: take the one the model was trained "
                 "with (CPM-2's bpe_cn/ or bpe_cn_en/); the ids below are bpe_cn's.")
        return f"""# A CPM-2 model in Hugging Face T5 layout

Converted from the CPM-2 checkpoint {self.source} by data_tools/convert_checkpoint.py.

## Weights
`transformers.T5ForConditionalGeneration.from_pretrained` loads them: CPM-2 is a T5 with gated
GELU, an lm_head of its own and no rescaling of the decoder output (as in T5 v1.1).

## Tokenizer
CPM-2 does not use SentencePiece. Its tokenizer cuts text into words with jieba and each word
into word pieces from its vocabulary, with spaces and newlines written as the tokens `\u2582`
and `\u2583`. transformers has no such tokenizer: `T5Tokenizer` and `AutoTokenizer` cannot load
one from this folder, and a SentencePiece vocabulary would give other ids. Use
`megatron.data.tokenizers.cpm2_tokenizer.CPM2Tokenizer("vocab.txt")` (in the repository of the conversion
tool; it gives CPM-2's ids) or CPM-2's own `EncDecTokenizer` (src/tokenization_enc_dec.py of
CPM-2-Pretrain) with vocab.txt.

{vocab}

## Special ids
- decoder start: {c.decoder_start_token_id} (`<s>`; CPM-2-Finetune's targets begin `<s> <s_0>`)
- padding: {c.pad_token_id} (`<pad>`)
- end of document, the eos of generation_config.json: {c.eos_token_id} (`<eod>`)
- sentinels of span corruption: {sentinels}
"""
