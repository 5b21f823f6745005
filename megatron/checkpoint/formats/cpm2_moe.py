"""CPM-2-MoE checkpoints (the `moe` branch of CPM-2-Pretrain) as full tensors under our names, and
back (`convert_checkpoint.py --from cpm2 DIR` / `--to cpm2 OUT`).

CPM-2-MoE makes every block's feed-forward a BASE layer (their src/mpu/baselayer.py): one expert
per data-parallel rank, so E = the data-parallel size, each expert split over the model-parallel
ranks as the dense feed-forward is (cpm2_shards.py's table). A block's `ff` holds

    ff.expert_centroids                             [E, d_model]  routing: the same on every rank
                                                    (drawn with the same seed; computed under
                                                    no_grad, so never trained)
    ff.expert_network.dense_relu_dense.wi_0/wi_1    [d_ff/P, d_model]  data rank e's: expert e
    ff.expert_network.dense_relu_dense.wo           [d_model, d_ff/P]
    ff.expert_network.layer_norm.weight             [d_model]  not an expert parameter in their
                                                    optimizer (pretrain_enc_dec.py marks
                                                    'expert_network' without 'layer_norm'): its
                                                    gradient is averaged over data parallel, the
                                                    same on every rank

Two layouts, both 'model' state dicts (not DeepSpeed's 'module'):
- 'save', their training save (src/utils.py save_checkpoint without --deepspeed, as their scripts
  run): DIR/ITER/mp_rank_DD_MM_model_states.pt for data rank DD and model rank MM, each
  {'iteration', 'model'}; the tracker DIR/latest_checkpointed_iteration.txt is str(ITER) with
  no newline. (A --save path containing 'mt5-8-32' makes every data rank write and read
  mp_rank_MM: one expert survives, read as the 'init' layout.)
- 'init', init_ckpt.py's upcycling of CPM-2: DIR/ITER/mp_rank_MM_model_states.pt, one file per
  model rank, whose expert_network is the dense feed-forward (every data rank loads the same
  file: every expert is that copy), the centroids orthogonal_(gain=0.01) in fp16, beside the
  dense file's DeepSpeed keys; the tracker ends with a newline.

Ours (router_type 'cpm2', every block sparse): `{ff}.layer_norm.weight` (one per block: data rank
0's), `{ff}.mlp.experts.wi_0 / wi_1` [E, d_ff, d_model] and `.wo` [E, d_model, d_ff] (expert e =
data rank e), the buffer `{ff}.mlp.router.expert_centroids` [E, d_model].
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron.checkpoint.formats.cpm2_shards import (MOE_SHARD, TIED_COPIES, CPM2Checkpoint,
                                                     few, load_shard, module_state_dict,
                                                     shard_files, source_table)
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.layout import TRACKER
from megatron.model.config import ConfigError, T5Config
from megatron.model.state_dict import feed_forward_prefix

EXPERT = ".ff.expert_network."
CENTROIDS = ".ff.expert_centroids"
LAYOUTS = ("save", "init")


# Reading -----------------------------------------------------------------------------------------
def is_cpm2_moe(folder: Path) -> bool:
    """Whether an iteration folder holds a CPM-2-MoE checkpoint (either layout)."""
    if any(MOE_SHARD.fullmatch(p.name) for p in folder.iterdir()):
        return True
    first = folder / "mp_rank_00_model_states.pt"
    if not first.is_file():
        return False
    loaded = load_shard(first)
    model = loaded.get("model") if isinstance(loaded, dict) else None
    return isinstance(model, dict) and any(CENTROIDS in k or EXPERT in k for k in model)


def _dense_view(folder: Path, files: List[Path], modules: List[Dict[str, torch.Tensor]],
                iteration: int) -> CPM2Checkpoint:
    """One data rank's model-parallel files seen as a dense CPM-2 checkpoint (the expert network
    as the feed-forward, the centroids set aside), so that the dense reader's checks and merge
    of the model-parallel shards apply unchanged."""
    return CPM2Checkpoint(folder, files, [{k.replace(EXPERT, ".ff."): v for k, v in m.items()
                                           if CENTROIDS not in k} for m in modules], iteration)


class CPM2MoECheckpoint:
    """One iteration of a CPM-2-MoE checkpoint: its files (memory-mapped), one dense view per
    data rank (one in all for the 'init' layout).

    Raises:
        CheckpointReadError: a missing file (named, with why it is expected), a file that is not
            a CPM-2-MoE 'model' state dict, centroids that disagree with the number of experts.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.iteration = int(folder.name) if folder.name.isdigit() else 0
        found = {(int(m.group(1)), int(m.group(2))): p for p in folder.iterdir()
                 if (m := MOE_SHARD.fullmatch(p.name))}
        if found:
            self.layout = "save"
            dp = max(d for d, _ in found) + 1
            mp = max(m for _, m in found) + 1
            files = [[folder / f"mp_rank_{d:02d}_{m:02d}_model_states.pt" for m in range(mp)]
                     for d in range(dp)]
        else:
            self.layout = "init"
            files = [shard_files(folder)]
        missing = [f for row in files for f in row if not f.is_file()]
        if missing:
            raise CheckpointReadError(
                f"{missing[0]}: missing{_more(missing)}; {folder} has data ranks up to "
                f"{len(files) - 1} and model ranks up to {len(files[0]) - 1} "
                f"(mp_rank_DATA_MODEL_model_states.pt): the checkpoint is incomplete")
        modules = [[_model(f) for f in row] for row in files]
        self.views = [_dense_view(folder, row, mods, self.iteration)
                      for row, mods in zip(files, modules)]
        self.centroids = [[{k: v for k, v in m.items() if CENTROIDS in k} for m in mods]
                          for mods in modules]
        """[data rank][model rank] {their name: [E, d_model]}."""
        self.files = files
        self.model_parallel_size = len(files[0])
        centroids = self.centroids[0][0]
        if not centroids:
            raise CheckpointReadError(f"{files[0][0]}: no *{CENTROIDS}: not a CPM-2-MoE "
                                      f"checkpoint")
        rows = {tuple(t.shape)[0] for t in centroids.values()}
        self.num_experts = len(files) if self.layout == "save" else min(rows)
        for d, row in enumerate(self.centroids):
            for m, found_centroids in enumerate(row):
                bad = {k: tuple(t.shape) for k, t in found_centroids.items()
                       if t.dim() != 2 or t.shape[0] != self.num_experts}
                if bad:
                    name, shape = next(iter(bad.items()))
                    why = (f"{len(files)} data-parallel files (one expert each)"
                           if self.layout == "save" else f"{self.num_experts} experts elsewhere")
                    raise CheckpointReadError(
                        f"{files[d][m]}: {name} has shape {shape}: {shape[0]} experts, the "
                        f"checkpoint has {why}; is a data-parallel file missing or foreign?")

    def vocab_rows(self) -> int:
        return self.views[0].vocab_rows()

    def check(self, config: T5Config, source: str) -> None:
        """Every file's names and shapes against the dense form of `config` (CPM2Checkpoint.check),
        and the centroids: one [E, d_model] per block."""
        for view in self.views:
            view.check(config, source)
        want = {_their_prefix(config, stack, i) + CENTROIDS
                for stack in ("encoder", "decoder") for i in range(_layers(config, stack))}
        for d, row in enumerate(self.centroids):
            for m, found in enumerate(row):
                missing = sorted(want - set(found))
                if missing:
                    raise CheckpointReadError(f"{self.files[d][m]}: missing tensors: "
                                              f"{few(missing)}")

    def differences(self) -> List[str]:
        """Notes on the shared tensors (all but the experts) where a data rank's differ from
        data rank 0's, with the largest difference: they are averaged over data parallel (or
        never trained) and should agree; data rank 0's are taken."""
        notes = []
        for d, view in enumerate(self.views[1:], 1):
            worst, where = 0.0, ""
            for m, (mine, first) in enumerate(zip(view.modules, self.views[0].modules)):
                for name in first:
                    if ".ff.dense_relu_dense." in name:
                        continue
                    diff = _max_difference(mine[name], first[name])
                    if diff > worst:
                        theirs = name.replace(".ff.", EXPERT)  # the name in their file
                        worst, where = diff, f"{theirs} of {self.files[d][m].name}"
                for name, t in self.centroids[d][m].items():
                    diff = _max_difference(t, self.centroids[0][m][name])
                    if diff > worst:
                        worst, where = diff, f"{name} of {self.files[d][m].name}"
            if worst > 0:
                notes.append(f"{self.folder}: data rank {d}'s shared tensors differ from data "
                             f"rank 0's (largest difference {worst:.3g}, {where}); data rank 0's "
                             f"are taken")
        return notes

    def check_config(self, config: T5Config, source: str) -> None:
        """A model config of ours that has experts must have the checkpoint's, routed 'cpm2'
        (CPM-2's own config has none: the checkpoint's are taken).

        Raises:
            ConfigError: naming the config and what the checkpoint has.
        """
        if config.is_moe and (config.num_experts != self.num_experts
                              or config.router_type != "cpm2"):
            raise ConfigError(f"--model-config {source}: num_experts {config.num_experts} "
                              f"with router_type {config.router_type!r}; the checkpoint has "
                              f"{self.num_experts} experts (one per data-parallel rank) "
                              f"routed by CPM-2's BASE layer (router_type 'cpm2')")

    def sparse_config(self, dense: T5Config, source: str) -> T5Config:
        """The Mixture-of-Experts model's config: `dense` with the checkpoint's experts."""
        return moe_config(dense, self.num_experts, source)

    def notes(self) -> List[str]:
        """What is worth a warning: shared tensors that differ between data ranks; the 'init'
        layout's one expert network, copied to every expert."""
        notes = self.differences()
        if self.layout == "init":
            notes.append(f"{self.folder}: one expert network per model rank (init_ckpt.py's "
                         f"layout): each of the {self.num_experts} experts is a copy of it")
        return notes

    def tensors(self, dense: T5Config) -> Iterator[Tuple[str, torch.Tensor]]:
        """(our name, full tensor) of the Mixture-of-Experts model, in the stored dtype: the
        dense reader's, with each feed-forward's weights stacked over the data ranks and its
        centroids after them."""
        per_rank = [view.tensors(dense) for view in self.views]
        for items in zip(*per_rank):
            name, first = items[0]
            prefix, dense_ff, weight = name.partition(".DenseReluDense.")
            if not dense_ff:
                yield name, first
                continue
            weight = weight.removesuffix(".weight")
            copies = [t for _, t in items]
            if self.layout == "init":
                copies = copies * self.num_experts
            yield f"{prefix}.mlp.experts.{weight}", torch.stack(copies, 0)
            if weight == "wo":
                stack, i = prefix.split(".")[0], int(prefix.split(".")[2])
                theirs = _their_prefix(dense, stack, i) + CENTROIDS
                yield f"{prefix}.mlp.router.expert_centroids", \
                    self.centroids[0][0][theirs].clone()


def _more(missing: List[Path]) -> str:
    return f" (and {len(missing) - 1} more file(s))" if len(missing) > 1 else ""


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _model(path: Path) -> Dict[str, torch.Tensor]:
    """The 'model' state dict of a CPM-2-MoE file (their non-DeepSpeed save and init_ckpt.py both
    write 'model'; a 'module' is taken too), any 'module.' prefix removed."""
    loaded = load_shard(path)
    if isinstance(loaded, dict) and "model" in loaded and "module" not in loaded:
        loaded = {**loaded, "module": loaded["model"]}
    return module_state_dict(path, loaded)


def _layers(config: T5Config, stack: str) -> int:
    return config.num_decoder_layers if stack == "decoder" else config.num_layers


def _their_prefix(config: T5Config, stack: str, index: int) -> str:
    return f"{stack}.blocks.{index}"


def dense_config(config: T5Config) -> T5Config:
    """The dense model `config` makes sparse (the names the dense CPM-2 table knows)."""
    return dataclasses.replace(config, num_experts=0) if config.is_moe else config


def moe_config(dense: T5Config, num_experts: int, source: str) -> T5Config:
    """CPM-2-MoE's config: `dense` with E experts in every block, router 'cpm2'.

    Raises:
        ConfigError: the model cannot be built so.
    """
    try:
        return dataclasses.replace(dense, num_experts=num_experts, router_type="cpm2",
                                   encoder_sparse_step=1, decoder_sparse_step=1)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{source}: a CPM-2-MoE model with {num_experts} experts: {e}") \
            from None


# Writing -----------------------------------------------------------------------------------------
def their_order(config: T5Config, layout: str = "save") -> List[str]:
    """Their state dict's names in the order their EncDecModel lists them ('save'), or as
    init_ckpt.py leaves them ('init': the dense model's order with its feed-forward names moved
    to the end, renamed, then the centroids)."""
    if layout == "init":
        names = their_order(config)
        centroids = [f"{stack}.blocks.{i}{CENTROIDS}" for i in range(config.num_layers)
                     for stack in ("encoder", "decoder")]  # its loop: layer, then stack
        return ([n for n in names if ".ff." not in n] + [n for n in names if EXPERT in n]
                + centroids)
    out = ["word_embeds.weight", "lm_head.weight"]
    for stack in ("encoder", "decoder"):
        out += [f"{stack}.word_embeds.weight", f"{stack}.final_layernorm.weight"]
        for i in range(_layers(config, stack)):
            block = _their_prefix(config, stack, i)
            out.append(f"{block}.self_attn.self_attn.project.weight")
            if i == 0:
                out.append(f"{block}.self_attn.self_attn.relative_attention_bias.weight")
            out += [f"{block}.self_attn.self_attn.dense.weight",
                    f"{block}.self_attn.layer_norm.weight"]
            if stack == "decoder":
                out += [f"{block}.cross_attn.cross_attn.{n}.weight"
                        for n in ("project_q", "project_kv", "dense")]
                out.append(f"{block}.cross_attn.layer_norm.weight")
            out.append(block + CENTROIDS)
            out += [f"{block}{EXPERT}dense_relu_dense.{n}.weight" for n in ("wi_0", "wi_1", "wo")]
            out.append(f"{block}{EXPERT}layer_norm.weight")
    return out


def _shard(full: torch.Tensor, how: str, rank: int, size: int) -> torch.Tensor:
    """Model rank `rank`'s piece of a full tensor split 'rows' or 'cols' or kept ('same')."""
    return full if how == "same" else full.chunk(size, 1 if how == "cols" else 0)[rank]


def check_writable(config: T5Config, model_parallel_size: int, layout: str,
                   flag: str = "--target-tensor-parallel-size") -> None:
    """Raises ValueError (naming the flag) where CPM-2-MoE's code cannot hold `config`."""
    problems = []
    if not config.is_moe or config.router_type != "cpm2":
        problems.append("--to cpm2 writes CPM-2-MoE checkpoints: the model needs experts with "
                        f"router_type 'cpm2' (it has {config.num_experts} experts, router "
                        f"{config.router_type!r})")
    elif config.sparse_blocks(False) != list(range(config.num_layers)) or \
            config.sparse_blocks(True) != list(range(config.num_decoder_layers)):
        problems.append("--to cpm2: CPM-2-MoE has experts in every block (sparse steps 1)")
    for name, value in (("num_heads", config.num_heads), ("d_ff", config.d_ff),
                        ("vocab_size", config.vocab_size)):
        if value % model_parallel_size:
            problems.append(f"{flag} {model_parallel_size} does not divide {name} {value}")
    if layout not in LAYOUTS:
        problems.append(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if problems:
        raise ValueError("; ".join(problems))


def write_cpm2_moe_checkpoint(out: Path, tensors: Iterable[Tuple[str, torch.Tensor]],
                              config: T5Config, iteration: int, model_parallel_size: int,
                              layout: str = "save", dtype: Optional[torch.dtype] = None,
                              force: bool = False) -> List[Path]:
    """Write the full tensors of a CPM-2-MoE model of ours as CPM-2's code saves them (module
    docstring): 'save' (one file per data rank = expert and model rank) or 'init' (one per model
    rank, its expert network the experts' common weights). The whole model is held in memory
    (every file needs every block). Written to OUT.tmp and renamed; the files it wrote.

    Raises:
        ValueError: a model CPM-2-MoE cannot hold, a missing or extra tensor, experts that
            differ for 'init', an existing OUT without `force`.
    """
    from megatron.checkpoint.formats.hf import staged_folder

    check_writable(config, model_parallel_size, layout)
    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force to replace it")
    dense = dense_config(config)
    full = dict(tensors)
    if dtype is not None:
        full = {k: v.to(dtype) for k, v in full.items()}
    table = source_table(dense)
    experts = config.num_experts
    ff = {}  # our dense name of a feed-forward weight -> (stacked name, centroids name)
    for stack in ("encoder", "decoder"):
        for i in range(_layers(config, stack)):
            prefix = feed_forward_prefix(config, stack, i)
            for w in ("wi_0", "wi_1", "wo"):
                ff[f"{prefix}.DenseReluDense.{w}.weight"] = f"{prefix}.mlp.experts.{w}"
            ff[_their_prefix(config, stack, i) + CENTROIDS] = \
                f"{prefix}.mlp.router.expert_centroids"
    wanted = {ff.get(ours, ours) for ours in table} | \
        {v for k, v in ff.items() if k.endswith(CENTROIDS)}
    missing, extra = sorted(wanted - set(full)), sorted(set(full) - wanted)
    if missing or extra:
        raise ValueError(f"--to cpm2: the model's tensors do not make a CPM-2-MoE model: "
                         f"missing {few(missing) or 'none'}; unknown "
                         f"{few(extra) or 'none'}")
    if layout == "init":
        for ours, stacked in ff.items():
            t = full[stacked]
            if not ours.endswith(CENTROIDS) and not all(torch.equal(t[0], e) for e in t[1:]):
                raise ValueError(f"--to cpm2 in init_ckpt.py's layout needs every expert the "
                                 f"same; {stacked} differs between experts")
    data_ranks = range(experts) if layout == "save" else range(1)
    written = []
    with staged_folder(out) as tmp:
        folder = tmp / str(iteration)
        folder.mkdir()
        for d in data_ranks:
            for m in range(model_parallel_size):
                model = _rank_state_dict(full, table, ff, dense, d, m, model_parallel_size,
                                         layout)
                name = (f"mp_rank_{d:02d}_{m:02d}_model_states.pt" if layout == "save"
                        else f"mp_rank_{m:02d}_model_states.pt")
                state = {"iteration": iteration, "model": model}
                if layout == "init":
                    state["mp_world_size"] = model_parallel_size
                torch.save(state, folder / name)
                written.append(out / str(iteration) / name)
        (tmp / TRACKER).write_text(str(iteration) + ("\n" if layout == "init" else ""))
    return written


def _rank_state_dict(full: Dict[str, torch.Tensor], table, ff, dense: T5Config, d: int, m: int,
                     size: int, layout: str) -> "OrderedDict[str, torch.Tensor]":
    pieces: Dict[str, torch.Tensor] = {}
    fused: Dict[str, List[torch.Tensor]] = {}
    for ours, (theirs, how, part) in table.items():
        t = full[ff[ours]][d] if ours in ff else full[ours]
        if how == "fused":
            fused.setdefault(theirs, [None] * (3 if theirs.endswith(".project.weight") else 2))
            fused[theirs][part] = t.chunk(size, 0)[m]
            continue
        theirs = theirs.replace(".ff.", EXPERT) if ".ff." in theirs else theirs
        pieces[theirs] = _shard(t, how, m, size).clone()
    for theirs, parts in fused.items():
        pieces[theirs] = torch.cat(parts, 0)
    for ours, stacked in ff.items():
        if ours.endswith(CENTROIDS):
            pieces[ours] = full[stacked].clone()
    for copy in TIED_COPIES:
        pieces[copy] = pieces["word_embeds.weight"]
    return OrderedDict((name, pieces[name]) for name in their_order(dense, layout))
