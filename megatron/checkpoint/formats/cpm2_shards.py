"""CPM-2's checkpoint files: the iteration folders, the model-parallel shards, the loader that
opens them safely, and the dense model's tensors across the ranks (`CPM2Checkpoint`). cpm2.py
reads a checkpoint through them; cpm2_moe.py too (one dense view per data rank).

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

Files are opened with torch.load(mmap=True, weights_only=True), the numpy array of the RNG state
and DeepSpeed's own classes allowed; one tensor is assembled at a time.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from megatron.checkpoint.formats.deepspeed_files import (CheckpointReadError, allowed_globals,
                                                         only_globals)
from megatron.checkpoint.layout import ITERATION_PREFIX, TRACKER, TrackerError, read_tracker
from megatron.model.config import T5Config
from megatron.model.meta import full_parameter_shapes

SHARD = re.compile(r"mp_rank_(\d+)_model_states\.pt")
MOE_SHARD = re.compile(r"mp_rank_(\d+)_(\d+)_model_states\.pt")
"""CPM-2-MoE's training save: data rank, model rank (cpm2_moe.py)."""

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
    """One iteration of a dense CPM-2 checkpoint: its model-parallel files and their state dicts,
    checked against a config (`open(root, iteration)` reads them: root is the --save folder
    holding the tracker or an iteration folder itself; iteration, default the tracker's).

    Raises (open):
        CheckpointReadError: no tracker or iteration folder, a missing or unreadable shard,
            a folder of another format (with the flag that reads it).
    """

    def __init__(self, folder: Path, files: List[Path], modules: List[Dict[str, torch.Tensor]],
                 iteration: int) -> None:
        self.folder, self.files, self.size, self.iteration = folder, files, len(files), iteration
        self.modules = modules
        """Each model-parallel rank's state dict (their names)."""

    @classmethod
    def open(cls, root: PathLike, iteration: Optional[int] = None) -> "CPM2Checkpoint":
        """The checkpoint's files under `root` (see the class), loaded memory-mapped."""
        folder = find_iteration(Path(root), iteration)
        first = _shard_name(folder, 0)
        loaded = load_shard(first) if first.is_file() else None
        declared = loaded.get("mp_world_size") if isinstance(loaded, dict) else None
        files = shard_files(folder, declared if isinstance(declared, int) else None)
        modules = [module_state_dict(path, loaded if r == 0 else load_shard(path))
                   for r, path in enumerate(files)]
        return cls(folder, files, modules, _iteration_of(folder))

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
                                f"{few(unknown)}{hint}")
            missing = [n for n in want if n not in module and n not in TIED_COPIES]
            if missing:
                problems.append(f"missing tensors: {few(missing)}")
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


def few(names: List[str]) -> str:
    """The first six of `names`, and how many there are in all."""
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


def module_state_dict(path: Path, loaded: Any) -> Dict[str, torch.Tensor]:
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
        raise CheckpointReadError(f"{path}: 'module' entries that are not tensors: {few(bad)}")
    return module


def load_shard(path: Path) -> Any:
    """A shard file's contents, memory-mapped, loaded with only the classes CPM-2's saves hold.

    Raises:
        CheckpointReadError: a class this loader does not allow, a truncated or damaged file.
    """
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
