"""Every use of DeepSpeed's internals (private attributes, private group tables, undocumented
behaviour), as small named functions: the one place an upgrade of DeepSpeed can break.

Written against DeepSpeed 0.19.8 (each docstring names the code it relies on, under
deepspeed/); tests/unit/test_deepspeed_internals.py pins each behaviour against the installed
DeepSpeed, so that an upgrade that changes one fails there, by name. Public API (initialize,
zero.Init, zero.GatheredParameters, the engine's documented methods) is used where it is needed,
not here.

DeepSpeed is imported inside the functions that need it: its import takes seconds and logs on
stdout, and this module is imported by code that may run without an engine.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

DEEPSPEED_VERSION = "0.19.8"
"""The version these functions were read against (tests/unit/test_deepspeed_internals.py)."""


# Expert parallelism (megatron/training/experts.py) -----------------------------------------------
def expert_group_name(expert_parallel_size: int) -> str:
    """The name DeepSpeed gives the expert groups of this size (`ep_size_<EP>`:
    utils/groups.py `_create_expert_and_data_parallel`, and `_get_max_expert_size`, which parses
    the size back out of the name)."""
    return f"ep_size_{expert_parallel_size}"


def register_expert_groups(name: str, expert_group, expert_ranks: Sequence[int],
                           expert_data_group, expert_data_ranks: Sequence[int]) -> None:
    """Make our expert-parallel and expert-data-parallel groups DeepSpeed's, under `name`.

    DeepSpeed keeps them in four module dicts of utils/groups.py (`_EXPERT_PARALLEL_GROUP`,
    `_EXPERT_PARALLEL_GROUP_RANKS`, `_EXPERT_DATA_PARALLEL_GROUP`,
    `_EXPERT_DATA_PARALLEL_GROUP_RANKS`), read by its getters (`_get_expert_parallel_group`,
    `_get_expert_data_parallel_group`, their `_ranks` and `_dict` forms) from the engine's
    gradient reduction, the ZeRO optimizers and the MoE checkpoint code. The tables are
    cleared first: an earlier engine in this process (tests) may have left groups, since
    destroyed, under another size, and the checkpoint code takes the largest size it finds.
    """
    from deepspeed.utils import groups

    tables = (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
              groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS)
    for table in tables:
        table.clear()
    groups._EXPERT_PARALLEL_GROUP[name] = expert_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = expert_ranks
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = expert_data_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = expert_data_ranks


def mark_expert_parameter(param: nn.Parameter, name: str) -> None:
    """Make `param` an expert's for DeepSpeed: `param.allreduce = False` and
    `param.group_name = name`. The engine reduces such a gradient over the expert-data-parallel
    group of that name (runtime/engine.py `_reduce_expert_gradients`, via
    moe/utils.py `is_moe_param`), and `split_params_into_different_moe_groups_for_optimizer`
    (moe/utils.py) puts it into the `moe` parameter group of that name."""
    param.allreduce = False
    param.group_name = name


def is_expert_parameter(param: nn.Parameter) -> bool:
    """Whether DeepSpeed takes `param` for an expert's (moe/utils.py `is_moe_param`)."""
    from deepspeed.moe.utils import is_moe_param

    return bool(is_moe_param(param))


@functools.lru_cache(maxsize=None)
def _expert_marker_class() -> type:
    # the class derives from DeepSpeed's MoE, which is imported when first needed (module
    # docstring): made once per process, so isinstance and pickling see one class
    from deepspeed.moe.layer import MoE

    class DeepSpeedExperts(MoE):
        """Tells DeepSpeed's engine that the model has experts (`expert_marker`)."""

        def __init__(self, num_experts: int, ep_size: int, group_name: str) -> None:
            nn.Module.__init__(self)  # not MoE.__init__: no gate, no experts, no parameters
            self.num_experts = num_experts
            self.ep_size = ep_size
            self.expert_group_name = group_name
            self.num_local_experts = 0  # DeepSpeed writes no expert files: ours do

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            """The engine's call to create the groups: `register_expert_groups` did."""

        def forward(self, *args, **kwargs):
            raise RuntimeError("a marker for DeepSpeed's engine, not a layer")

    DeepSpeedExperts.__qualname__ = "DeepSpeedExperts"
    return DeepSpeedExperts


def expert_marker(num_experts: int, ep_size: int, group_name: str) -> nn.Module:
    """A module without parameters or state that turns on DeepSpeed's expert handling when
    added to the model: the engine sets `has_moe_layers` when the module holds an instance of
    `deepspeed.moe.layer.MoE` (runtime/engine.py `_configure_distributed_model`) and then calls
    its `set_deepspeed_parallelism` (a no-op here: the groups are registered). It reads
    `num_experts`; the MoE checkpoint code (`_save_moe_checkpoint`, `load_moe_state_dict`)
    reads `num_local_experts` (0: it writes and reads no expert files of its own) and
    `expert_group_name`."""
    return _expert_marker_class()(num_experts, ep_size, group_name)


# ZeRO-3 parameters -------------------------------------------------------------------------------
def is_zero3_parameter(param: torch.Tensor) -> bool:
    """Whether `param` is partitioned by ZeRO-3: zero.Init gives each such parameter `ds_id`
    (runtime/zero/partition_parameters.py `_convert_to_deepspeed_param`)."""
    return hasattr(param, "ds_id")


def zero3_partition(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's partition of a ZeRO-3 parameter between forwards, `param.ds_tensor` (flat,
    padded with zeros to an equal size per rank; on the CPU with --offload-param cpu;
    partition_parameters.py `_partition_param`); None for a parameter ZeRO-3 does not hold."""
    return getattr(param, "ds_tensor", None)


def stored_tensor(param: torch.Tensor) -> Optional[torch.Tensor]:
    """What this rank holds of `param` between steps: its ZeRO-3 partition (`zero3_partition`,
    None before it is partitioned) or the parameter itself."""
    return zero3_partition(param) if hasattr(param, "ds_tensor") else param


def full_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """A parameter's shape on this rank before partitioning: ZeRO-3 records it as `ds_shape`
    (the parameter itself is then empty; partition_parameters.py)."""
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def full_numel(param: torch.Tensor) -> int:
    """A parameter's element count before partitioning (ZeRO-3's `ds_numel`)."""
    return int(getattr(param, "ds_numel", param.numel()))


def gathered_for_write(param: torch.Tensor):
    """A context in which `param` is whole and what rank 0 writes into it is partitioned back
    (zero.GatheredParameters with modifier_rank 0) for a ZeRO-3 parameter; nothing otherwise."""
    if not is_zero3_parameter(param):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


# The optimizer: loss scale, masters, Adam's states -----------------------------------------------
def loss_scale(optimizer) -> float:
    """The current loss scale of DeepSpeed's optimizer; 1.0 where it keeps none (bf16, fp32).

    The ZeRO-1/2 and ZeRO-3 optimizers expose `cur_scale` (a property over
    `loss_scaler.cur_scale`: runtime/zero/stage_1_and_2.py, stage3.py); the fp16 optimizer
    without ZeRO keeps a `loss_scaler` (runtime/fp16/loss_scaler.py `LossScalerBase.cur_scale`).
    """
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(optimizer, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0


def refresh_masters(optimizer) -> bool:
    """Copy the model's (just loaded) weights into the optimizer's fp32 masters, where the
    optimizer keeps masters of its own (`refresh_fp32_params` of the ZeRO, bf16 and fp16
    optimizers); returns whether it did."""
    refresh = getattr(optimizer, "refresh_fp32_params", None)
    if refresh is None:
        return False
    refresh()
    return True


@contextlib.contextmanager
def frozen_weights_from_module(engine):
    """Within: the engine's checkpoint loads read a model with frozen parameters (prompt tuning)
    from a checkpoint saved when nothing was frozen. A ZeRO-2 save writes an empty
    `frozen_param_fragments`, and `load_module_state_dict` (runtime/engine.py) looks every frozen
    parameter up in it once it is not None (KeyError), although their weights came with
    'module'; the empty table is dropped as the files are read (the engine's
    `checkpoint_engine.load`, which runtime/state_dict_factory.py calls)."""
    from deepspeed.checkpoint.constants import FROZEN_PARAM_FRAGMENTS

    real = engine.checkpoint_engine

    class Reading:
        def __getattr__(self, name):
            return getattr(real, name)

        def load(self, path, map_location=None):
            state = real.load(path, map_location=map_location)
            if isinstance(state, dict) and FROZEN_PARAM_FRAGMENTS in state \
                    and not state[FROZEN_PARAM_FRAGMENTS]:
                del state[FROZEN_PARAM_FRAGMENTS]
            return state

    engine.checkpoint_engine = Reading()
    try:
        yield
    finally:
        engine.checkpoint_engine = real


def linked_partitions(optimizer
                      ) -> Optional[Tuple[List[List[nn.Parameter]], List[torch.Tensor]]]:
    """(the model's parameters by group, this rank's flat fp32 partition of each group) of an
    optimizer that links each parameter to its fragment of the partition (`_hp_mapping`): the
    ZeRO-1/2 optimizer (`bit16_groups`, `single_partition_of_fp32_groups`:
    runtime/zero/stage_1_and_2.py) and the bf16 optimizer (`bf16_groups`,
    `fp32_groups_flat_partition`: runtime/bf16_optimizer.py); None for another optimizer."""
    for params, flats in (("bit16_groups", "single_partition_of_fp32_groups"),
                          ("bf16_groups", "fp32_groups_flat_partition")):
        if hasattr(optimizer, params) and hasattr(optimizer, flats):
            return getattr(optimizer, params), getattr(optimizer, flats)
    return None


def fragment_mapping(param: torch.Tensor):
    """The link of a parameter to its fragment of this rank's fp32 partition
    (utils/tensor_fragment.py `tensor_fragment`: `hp_fragment`, `lp_fragment_address`,
    `hp_fragment_address`, `get_lp_grad_fragment`), set as `param._hp_mapping` by the ZeRO-1/2
    and bf16 optimizers; None where no element of `param` is in this rank's partition or the
    optimizer links none."""
    return getattr(param, "_hp_mapping", None)


def has_fragment_mapping(param: torch.Tensor) -> bool:
    """Whether the optimizer links `param` to partitions at all (`_hp_mapping` exists, even
    when None on this rank)."""
    return hasattr(param, "_hp_mapping")


def local_fragment_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's fragment of `param`'s reduced gradient under the ZeRO-1/2 or bf16
    optimizer, flat (`_hp_mapping.get_lp_grad_fragment(param._index_in_param_group)`, narrowed
    to the fragment where the optimizer returns the whole gradient, as the bf16 optimizer does:
    utils/tensor_fragment.py); None where this rank holds none of it."""
    mapping = fragment_mapping(param)
    if mapping is None:
        return None
    grad = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
    if grad.numel() == param.numel():
        address = mapping.lp_fragment_address
        grad = grad.narrow(0, address.start, address.numel)
    return grad


def relink_optimizer_states(optimizer) -> None:
    """Have DeepSpeed link its fragments to the Adam states now set on its flat partitions.
    It does so once, lazily, at the first step (`_lazy_init_hp_params_optimizer_state`, guarded
    by `_hp_optimizer_states_linked`: runtime/zero/stage_1_and_2.py, runtime/bf16_optimizer.py);
    the flag is reset so that the link is made again."""
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()


def zero3_flat_partitions(optimizer) -> List[torch.Tensor]:
    """ZeRO-3's flat fp32 partition of each sub-group (runtime/zero/stage3.py
    `fp32_partitioned_groups_flat`), the tensors its inner optimizer steps."""
    return list(optimizer.fp32_partitioned_groups_flat)


def zero3_swaps_optimizer(optimizer) -> bool:
    """Whether ZeRO-3 swaps some optimizer sub-group to NVMe (stage3.py
    `_swappable_optimizer_subgroup`): its states are then not in memory to be set."""
    return any(optimizer._swappable_optimizer_subgroup(i)
               for i in range(len(optimizer.fp32_partitioned_groups_flat)))


# The engine --------------------------------------------------------------------------------------
def wrap_model_step(engine, before: Callable[[], None]) -> None:
    """Call `before()` at each optimizer step of `engine`, after the gradients are reduced and
    before they are clipped and applied: the engine's `_take_model_step` (runtime/engine.py,
    called by `step()` at the accumulation boundary, also by the PipelineEngine) is wrapped."""
    take_model_step = engine._take_model_step

    def measured_take_model_step(*args, **kwargs):
        before()
        return take_model_step(*args, **kwargs)

    engine._take_model_step = measured_take_model_step


def pipeline_instructions(engine) -> Optional[Dict[type, Callable]]:
    """The PipelineEngine's table from instruction class to the method that runs it
    (runtime/pipe/engine.py `_INSTRUCTION_MAP`, a class attribute read as
    `self._INSTRUCTION_MAP` by `_exec_schedule`); None for another engine."""
    table = getattr(type(engine), "_INSTRUCTION_MAP", None)
    return table if isinstance(table, dict) else None


def set_pipeline_instructions(engine, table: Dict[type, Callable]) -> None:
    """Run this engine's instructions with `table` (methods taking the engine first, like the
    class's own); set on the instance, so other engines are not touched."""
    engine._INSTRUCTION_MAP = dict(table)


def skip_lone_pipeline_allreduce(engine) -> None:
    """Stop a PipelineEngine from all-reducing the gradients over its data-parallel group
    (`pipeline_enable_backward_allreduce`, runtime/pipe/engine.py: it flattens every gradient
    even for a group of one). Only for a data-parallel size of 1 without ZeRO."""
    engine.pipeline_enable_backward_allreduce = False


def run_before_optimizer_step(engine, hook: Callable[[], None]) -> None:
    """Call `hook()` just before the optimizer of a ZeRO-0 fp32 engine steps, after the
    engine's own clipping (off when we clip ourselves): without ZeRO and 16-bit, DeepSpeed's
    `engine.optimizer` is the torch optimizer it was given, so torch's step pre-hook
    runs there, once per optimizer step (runtime/engine.py `_configure_optimizer`: a client
    optimizer is kept as the engine's optimizer when no ZeRO, fp16 or bf16 wrapper applies)."""
    engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: hook())


def zero0_fp32_grad_norm(parameters: Iterable[nn.Parameter], mpu) -> float:
    """The norm DeepSpeed's ZeRO-0 fp32 clipping takes (runtime/utils.py `clip_grad_norm_`
    with max_norm infinite, so nothing is scaled): the squares of tensor shards summed over the
    model-parallel group of `mpu` (megatron.parallel_state), replicated weights counted on
    model-parallel rank 0, then the norm averaged over the data-parallel group (ranks holding
    different experts get neither's norm: training/experts.py). Tied pipeline copies marked
    `ds_pipe_replicated` are counted, unlike in the ZeRO and 16-bit optimizers' norms
    (training/pipeline_step.py clips itself there)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    return float(clip_grad_norm_(list(parameters), max_norm=float("inf"), mpu=mpu))


PIPE_REPLICATED = "ds_pipe_replicated"  # a constant here: its readers need no DeepSpeed import
"""The flag the PipelineEngine sets on the copies of a tied module beyond the first
(runtime/pipe/module.py `_index_tied_modules`; the name is runtime/constants.py
`PIPE_REPLICATED`); the ZeRO-1/2 and bf16 optimizers' norms leave them out
(runtime/zero/stage_1_and_2.py, runtime/bf16_optimizer.py), `zero0_fp32_grad_norm` does not.
megatron/tensor_parallel/layers.py `counts_in_norm` reads it by name (a lower floor)."""


def is_pipe_replicated(param: torch.Tensor) -> bool:
    """Whether `param` is a tied copy DeepSpeed's gradient norms leave out (PIPE_REPLICATED)."""
    return bool(getattr(param, PIPE_REPLICATED, False))


# Building DeepSpeed's CUDA ops (FusedAdam, CPU Adam) -------------------------------------------
def arch_list_deepspeed_reads(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder can parse it: arch-specific entries such as
    `9.0a` (Hopper's wgmma features, set by many H100/H200 images) become `9.0`, `+PTX` is kept.

    `CUDAOpBuilder.compute_capability_args` (ops/op_builder/builder.py) sorts the entries by
    `int()` of each dot-separated part and fails with "invalid literal for int() with base 10:
    '0a'"; DeepSpeed's own kernels use no arch-specific instruction, so sm_90 code is what they
    need on such a chip."""
    entries = arch_list.replace(" ", ";").split(";")
    out = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        arch, ptx = (entry[:-4], "+PTX") if entry.endswith("+PTX") else (entry, "")
        arch = arch.rstrip("aAfF") if "." in arch else arch
        if arch + ptx not in out:
            out.append(arch + ptx)
    return ";".join(out)


@contextlib.contextmanager
def deepspeed_op_build_env():
    """Around the first use of a DeepSpeed op (its JIT build reads TORCH_CUDA_ARCH_LIST and writes
    it back): the user's list in the form `arch_list_deepspeed_reads` gives, restored after."""
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if saved is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list_deepspeed_reads(saved)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
