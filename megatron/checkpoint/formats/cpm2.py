"""CPM-2 checkpoints (CPM-2-Pretrain, CPM-2-Finetune) as full tensors under our names, and the
CPM-2 parts of a Hugging Face export (its vocab.txt and a README naming the tokenizer).

What CPM-2's save writes (its src/utils.py save_checkpoint, DeepSpeed branch: the engine's
save_checkpoint under the tag str(iteration), then the tracker):

    DIR/latest_checkpointed_iteration.txt   the iteration as a plain number, written last
    DIR/ITER/mp_rank_XX_model_states.pt     model-parallel rank XX; 'module' is the model's state
                                            dict, beside DeepSpeed's keys and CPM-2's client
                                            state (iteration, RNG states, one a numpy array)
    DIR/ITER/zero_pp_rank_D_mp_rank_XX_optim_states.pt   the ZeRO-1 optimizer (not read)

The folder is the bare number (not iter_NNNNNNN). The model config is not saved: it is the JSON
the run passed as --model-config. The vocabulary is not padded: the embedding has
len(vocab.txt) rows (make_vocab_size_divisible_by is parsed but unused), split evenly by rank.

How rank r of P holds each tensor (their src/mpu/layers.py, src/mpu/transformer_enc_dec.py,
src/model/enc_dec_modeling.py); heads r*n/P ... (r+1)*n/P - 1 live on rank r throughout:

    word_embeds, lm_head           [V/P, d]   rows r*V/P ... (VocabParallelEmbedding); the encoder
                                              and decoder list word_embeds again (one tensor)
    self_attn.self_attn.project    [3h/P, d]  stride 3: [q_r; k_r; v_r], q_r = q's rows of rank r
    cross_attn.cross_attn.project_q  [h/P, d];  project_kv [2h/P, d], stride 2: [k_r; v_r]
    *.dense (attention out), ff.dense_relu_dense.wo    [d, h/P] / [d, f/P]: split on dim 1
    ff.dense_relu_dense.wi_0, wi_1 [f/P, d]
    relative_attention_bias        [buckets, n/P] (block 0 of each stack; an nn.Embedding)
    *layer_norm*, final_layernorm  [d], the same on every rank (rank 0's is taken)

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
Files are opened with torch.load(mmap=True, weights_only=True), the numpy array of the RNG state
and DeepSpeed's own classes allowed; one tensor is assembled at a time.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from megatron.checkpoint.formats.deepspeed_files import (CheckpointReadError, allowed_globals,
                                                         only_globals)
from megatron.checkpoint.layout import ITERATION_PREFIX, TRACKER, TrackerError, read_tracker
from megatron.model.config import ConfigError, T5Config
from megatron.model.meta import full_parameter_shapes

SHARD = re.compile(r"mp_rank_(\d+)_model_states\.pt")
MOE_SHARD = re.compile(r"mp_rank_(\d+)_(\d+)_model_states\.pt")  # CPM-2-MoE: cpm2_moe.py
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

PathLike = Union[str, Path]


# The tensors -------------------------------------------------------------------------------------
def source_table(config: T5Config) -> Dict[str, Tuple[str, str, int]]:
    """{our name: (their name, how, arg)} in our model's order. how: 'rows'/'cols' joins the
    ranks on dim 0/1; 'fused' takes part `arg` of each rank's [q; k; v] or [k; v];
    'same' takes rank 0's replicated tensor."""
    out: Dict[str, Tuple[str, str, int]] = {}
    for name in full_parameter_shapes(config):
        out[name] = _their_name(name)
    return out


def _their_name(ours: str) -> Tuple[str, str, int]:
    if ours in ("shared.weight", "lm_head.weight"):
        return ("word_embeds.weight" if ours == "shared.weight" else ours), "rows", 0
    stack, rest = ours.split(".", 1)
    if rest == "final_layer_norm.weight":
        return f"{stack}.final_layernorm.weight", "same", 0
    _, i, _, j, module, leaf = rest.split(".", 5)  # block.I.layer.J.MODULE.LEAF...
    block = f"{stack}.blocks.{i}"
    part = ("self_attn", "cross_attn", "ff")[int(j)] if stack == "decoder" else \
        ("self_attn", "ff")[int(j)]
    if module == "layer_norm":
        return f"{block}.{part}.layer_norm.weight", "same", 0
    proj = leaf.split(".")[0]
    if part == "ff":
        return f"{block}.ff.dense_relu_dense.{proj}.weight", "cols" if proj == "wo" else "rows", 0
    attn = f"{block}.{part}.{part}"
    if proj == "o":
        return f"{attn}.dense.weight", "cols", 0
    if proj == "relative_attention_bias":
        return f"{attn}.relative_attention_bias.weight", "cols", 0
    if part == "cross_attn":
        return ((f"{attn}.project_q.weight", "rows", 0) if proj == "q" else
                (f"{attn}.project_kv.weight", "fused", "kv".index(proj)))
    return f"{attn}.project.weight", "fused", "qkv".index(proj)


TIED_COPIES = ("encoder.word_embeds.weight", "decoder.word_embeds.weight")


def rank_shapes(config: T5Config, size: int) -> Dict[str, Tuple[int, ...]]:
    """{their name: its shape on each of `size` ranks}, the embedding's copies included."""
    full = full_parameter_shapes(config)
    out = {}
    for ours, (theirs, how, _) in source_table(config).items():
        shape = list(full[ours])
        if how == "fused":
            shape[0] *= 3 if theirs.endswith(".project.weight") else 2
        if how != "same":
            dim = 1 if how == "cols" else 0
            shape[dim] //= size
        out[theirs] = tuple(shape)
    for name in TIED_COPIES:
        out[name] = out["word_embeds.weight"]
    return out


class CPM2Checkpoint:
    """One iteration of a CPM-2 checkpoint: its files (memory-mapped), checked against a config.

    Args:
        root: the --save folder (holding the tracker) or an iteration folder itself.
        iteration: the one to read (default: the tracker's).
    Raises:
        CheckpointReadError: no tracker or iteration folder, a missing or unreadable shard,
            a folder of another format (with the flag that reads it).
    """

    def __init__(self, root: PathLike, iteration: Optional[int] = None) -> None:
        self.folder = find_iteration(Path(root), iteration)
        first = _shard_name(self.folder, 0)
        loaded = _load(first) if first.is_file() else None
        declared = loaded.get("mp_world_size") if isinstance(loaded, dict) else None
        self.files = shard_files(self.folder, declared if isinstance(declared, int) else None)
        self.size = len(self.files)
        self.iteration = _iteration_of(self.folder)
        self.modules = [_module(path, loaded if r == 0 else _load(path))
                        for r, path in enumerate(self.files)]

    def vocab_rows(self) -> int:
        """The vocabulary size the checkpoint holds (rank 0's rows x the model-parallel size)."""
        if "word_embeds.weight" not in self.modules[0]:
            raise CheckpointReadError(f"{self.files[0]}: no word_embeds.weight: not a CPM-2 "
                                      f"encoder-decoder")
        return self.modules[0]["word_embeds.weight"].shape[0] * self.size

    def check(self, config: T5Config, config_source: str) -> None:
        """Every rank's names and shapes against `config` (all problems of the first file that
        has any, in one message), and the embedding's copies against it.

        Raises:
            CheckpointReadError: unknown or missing tensors, shapes that do not fit.
        """
        want = rank_shapes(config, self.size)
        if config.num_heads % self.size or config.d_ff % self.size:
            raise CheckpointReadError(f"{self.folder}: {self.size} model-parallel ranks cannot "
                                      f"split num_heads {config.num_heads} and d_ff "
                                      f"{config.d_ff} of {config_source}")
        for path, module in zip(self.files, self.modules):
            problems = []
            unknown = sorted(set(module) - set(want))
            if unknown:
                hint = " (prompt tuning's prompt_embeds are not part of a T5 model)" \
                    if any("prompt" in n for n in unknown) else ""
                problems.append(f"tensors a CPM-2 model of this config does not have: "
                                f"{_few(unknown)}{hint}")
            missing = [n for n in want if n not in module and n not in TIED_COPIES]
            if missing:
                problems.append(f"missing tensors: {_few(missing)}")
            shapes = [f"{name} has shape {tuple(module[name].shape)}, {config_source} at "
                      f"model-parallel size {self.size} needs {shape}"
                      for name, shape in want.items()
                      if name in module and tuple(module[name].shape) != shape]
            if shapes:
                problems.append("; ".join(shapes[:3]) + (f"; ... ({len(shapes)} tensors in all)"
                                                          if len(shapes) > 3 else ""))
            if problems:
                raise CheckpointReadError(f"{path}: " + "; ".join(problems) + _depth_hint(
                    module, config))
            for name in TIED_COPIES:
                if name in module and not _same(module[name], module["word_embeds.weight"]):
                    raise CheckpointReadError(f"{path}: {name} differs from word_embeds.weight;"
                                              f" CPM-2's encoder and decoder share one")

    def tensors(self, config: T5Config) -> Iterator[Tuple[str, torch.Tensor]]:
        """(our name, full tensor) in our model's order, in the stored dtype; `check` first."""
        for ours, (theirs, how, part) in source_table(config).items():
            shards = [module[theirs] for module in self.modules]
            if how == "same":
                yield ours, shards[0].clone()
            elif how == "fused":
                pieces = 3 if theirs.endswith(".project.weight") else 2
                yield ours, torch.cat([s.chunk(pieces, 0)[part] for s in shards], 0)
            else:
                yield ours, torch.cat(shards, 1 if how == "cols" else 0)


def _few(names: List[str]) -> str:
    return ", ".join(names[:6]) + (f" ... ({len(names)} in all)" if len(names) > 6 else "")


def _depth_hint(module: Dict[str, Any], config: T5Config) -> str:
    found = {}
    for name in module:
        m = re.match(r"(encoder|decoder)\.blocks\.(\d+)\.", name)
        if m:
            found[m.group(1)] = max(found.get(m.group(1), 0), int(m.group(2)) + 1)
    if found.get("encoder", config.num_layers) != config.num_layers \
            or found.get("decoder", config.num_decoder_layers) != config.num_decoder_layers:
        return (f" (the checkpoint has {found.get('encoder')} encoder and "
                f"{found.get('decoder')} decoder blocks, the config {config.num_layers} and "
                f"{config.num_decoder_layers}: is --model-config the run's?)")
    return " (is --model-config the run's?)"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() \
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride():
        return True
    return torch.equal(a, b)


# The folders and files ---------------------------------------------------------------------------
def find_iteration(root: Path, iteration: Optional[int] = None) -> Path:
    """The iteration folder: ROOT/ITER for `iteration` or the tracker's; ROOT itself when it
    holds the shards.

    Raises:
        CheckpointReadError: no such folder, no or a garbled tracker, a missing iteration folder,
            a folder of another format (named, with the flag that reads it).
    """
    if not root.is_dir():
        raise CheckpointReadError(f"{root}: no such checkpoint folder")
    if iteration is None and any(SHARD.fullmatch(p.name) or MOE_SHARD.fullmatch(p.name)
                                 for p in root.iterdir()):
        return root
    foreign = _foreign(root)
    if foreign:
        raise CheckpointReadError(f"{root}: not a CPM-2 checkpoint: {foreign}")
    tracker = root / TRACKER
    if iteration is None:
        if not tracker.is_file():
            found = _iteration_folders(root)
            hint = (f"; it has iteration folders {', '.join(found[-3:])}: pass --iteration N "
                    f"to read one" if found else "; it has no iteration folders either")
            raise CheckpointReadError(f"{tracker}: missing, so the iteration to read is "
                                      f"unknown{hint}")
        try:
            name = str(read_tracker(root, release_ok=True, hint="pass --iteration N"))
        except TrackerError as e:
            raise CheckpointReadError(str(e)) from None
        said = f" ({tracker.name} names it)"
    else:
        name, said = str(int(iteration)), ""
    folder = root / name
    if not folder.is_dir():
        found = _iteration_folders(root)
        raise CheckpointReadError(f"{folder}: missing{said}; iteration folders in {root}: "
                                  f"{', '.join(found) or 'none'}")
    return folder


def _iteration_folders(root: Path) -> List[str]:
    names = [p.name for p in root.iterdir() if p.is_dir() and any(p.glob("mp_rank_*.pt"))]
    return sorted(names, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))


def _foreign(root: Path) -> str:
    """What another format's folder looks like, with the flag to read it ('' if none)."""
    if (root / "config.json").is_file() and any((root / n).is_file() for n in (
            "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")):
        return "it is a Hugging Face model folder; convert it with --from hf"
    if (root / "meta.json").is_file() or any(root.glob(ITERATION_PREFIX + "*/meta.json")):
        return "it is a checkpoint of our trainer; convert it with --load"
    if any(root.glob(ITERATION_PREFIX + "*/mp_rank_*/model_optim_rng.pt")):
        return ("it was saved without DeepSpeed (iter_N/mp_rank_XX/model_optim_rng.pt); this "
                "reader reads CPM-2's DeepSpeed saves (ITER/mp_rank_XX_model_states.pt)")
    return ""


def _iteration_of(folder: Path) -> int:
    return int(folder.name) if folder.name.isdigit() else 0


def shard_files(folder: Path, declared: Optional[int] = None) -> List[Path]:
    """mp_rank_00 ... mp_rank_{P-1}_model_states.pt: P is the model-parallel size rank 0's file
    declares (DeepSpeed's 'mp_world_size'), else one more than the highest rank present.

    Raises:
        CheckpointReadError: none there, or one of them missing (named).
    """
    ranks = sorted(int(m.group(1)) for p in folder.iterdir() if (m := SHARD.fullmatch(p.name)))
    if not ranks:
        raise CheckpointReadError(f"{folder}: no mp_rank_XX_model_states.pt: not an iteration "
                                  f"folder of a CPM-2 checkpoint")
    size = max(ranks[-1] + 1, declared or 0)
    missing = [_shard_name(folder, r) for r in range(size) if r not in ranks]
    if missing:
        why = f"{_shard_name(folder, 0).name} records model-parallel size {size}" \
            if declared == size else f"ranks up to {size - 1} are there"
        more = f" (and {len(missing) - 1} more rank(s))" if len(missing) > 1 else ""
        raise CheckpointReadError(f"{missing[0]}: missing{more}; {why}: the checkpoint is "
                                  f"incomplete")
    return [_shard_name(folder, r) for r in range(size)]


def _shard_name(folder: Path, rank: int) -> Path:
    return folder / f"mp_rank_{rank:02d}_model_states.pt"


def _numpy_globals() -> list:
    """What a pickled numpy array (CPM-2's saved np.random state) needs, under numpy 1.x's and
    2.x's module names."""
    import numpy as np
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    out: list = [np.ndarray, np.dtype]
    out += sorted({type(np.dtype(code)) for code in "?bhilqBHILQefdgFDGSUVO"}, key=str)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(_reconstruct, f"{module}._reconstruct"), (scalar, f"{module}.scalar")]
    return out


def _module(path: Path, loaded: Any) -> Dict[str, torch.Tensor]:
    """The 'module' state dict of a loaded shard, any 'module.' prefix removed."""
    if not isinstance(loaded, dict) or not isinstance(loaded.get("module"), dict):
        keys = ", ".join(map(str, list(loaded)[:6])) if isinstance(loaded, dict) else \
            type(loaded).__name__
        raise CheckpointReadError(f"{path}: no 'module' state dict (it holds {keys}): not a "
                                  f"CPM-2 DeepSpeed model-states file")
    module = loaded["module"]
    while module and all(k.startswith("module.") for k in module):
        module = {k[len("module."):]: v for k, v in module.items()}
    bad = [k for k, v in module.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointReadError(f"{path}: 'module' entries that are not tensors: {_few(bad)}")
    return module


def _load(path: Path) -> Any:
    try:
        with only_globals(allowed_globals() + _numpy_globals()):
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                # torch < 1.6's format cannot be mapped: read it whole
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(e))
        what = next(g for g in found.groups() if g) if found else "an object of another kind"
        raise CheckpointReadError(f"{path}: holds {what}, which this reader does not load (it "
                                  f"allows tensors, plain values, numpy arrays and DeepSpeed's "
                                  f"loss scaler)") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointReadError(f"{path}: cannot be read ({first}); the file is truncated or "
                                  f"damaged") from None


def read_cpm2_checkpoint(root: PathLike, model_config: PathLike,
                         iteration: Optional[int] = None, vocab: Optional[PathLike] = None
                         ) -> Tuple[T5Config, Iterator[Tuple[str, torch.Tensor]], Dict[str, Any],
                                    List[str]]:
    """A CPM-2 checkpoint as (config, (our name, full tensor) one at a time in our model's
    order, a description of the source, notes worth a warning). Everything is checked before
    the iterator is returned: the files, every rank's names and shapes against the config, the
    vocabulary.

    Args:
        root: the --save folder (or an iteration folder).
        model_config: the run's --model-config (CPM-2's JSON or ours; see `read_config`).
        iteration: default the tracker's.
        vocab: vocab.txt (or its folder): its size is checked, the special ids taken from it.

    Raises:
        CheckpointReadError, ConfigError: one message naming the file (and the tensor).
    """
    from megatron.checkpoint.formats import cpm2_moe

    folder = find_iteration(Path(root), iteration)
    if cpm2_moe.is_cpm2_moe(folder):
        return cpm2_moe.read_cpm2_moe_checkpoint(folder, model_config, vocab)
    checkpoint = CPM2Checkpoint(root, iteration)
    config, notes = read_config(model_config, checkpoint.vocab_rows())
    if vocab is not None:
        path = vocab_file(vocab)
        config = with_special_ids(config, read_vocab(path), path)
    checkpoint.check(config, str(model_config))
    source = {"format": "cpm2", "path": str(checkpoint.folder.resolve()),
              "iteration": checkpoint.iteration, "model_parallel_size": checkpoint.size,
              "model_config": str(Path(model_config).resolve())}
    return config, checkpoint.tensors(config), source, notes


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
