"""How a run builds the model: the architecture (T5Config) and the build options, and the
checks of the model flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

from megatron.model.config import ROUTER_TYPES, ConfigError, T5Config, load_preset
from megatron.model.t5 import model_parallel_problems


@dataclass(frozen=True)
class ModelConfig:
    """The architecture and how this run builds it."""

    t5: T5Config = field(default_factory=T5Config)
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    label_smoothing: float = 0.0
    expert_bias_update_rate: float = 1e-3
    """--moe-router-bias-update-rate: the step of the expert bias after each optimizer step."""
    compile: bool = False
    """--compile: torch.compile each transformer block (model/t5.py compile_blocks)."""


MOE_FLAGS = {
    # flag dest: (T5Config field, flag)
    "num_experts": ("num_experts", "--num-experts"),
    "moe_router_type": ("router_type", "--moe-router-type"),
    "moe_router_topk": ("router_topk", "--moe-router-topk"),
    "moe_aux_loss_coeff": ("router_aux_loss_coef", "--moe-aux-loss-coeff"),
    "moe_z_loss_coeff": ("router_z_loss_coef", "--moe-z-loss-coeff"),
    "moe_expert_capacity_factor": ("expert_capacity_factor", "--moe-expert-capacity-factor"),
    "moe_eval_capacity_factor": ("eval_expert_capacity_factor", "--moe-eval-capacity-factor"),
    "moe_router_enable_expert_bias": ("moe_expert_bias", "--moe-router-enable-expert-bias"),
    "moe_input_jitter_eps": ("router_jitter_noise", "--moe-input-jitter-eps"),
    "moe_encoder_sparse_step": ("encoder_sparse_step", "--moe-encoder-sparse-step"),
    "moe_decoder_sparse_step": ("decoder_sparse_step", "--moe-decoder-sparse-step"),
}
"""Mixture-of-Experts flags (megatron-core's names where it has one) and the model config
field each sets; a flag left out keeps the model config's value."""


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "mixture of experts", "set or override the model config's MoE fields (Hugging Face "
        "SwitchTransformers names); --expert-model-parallel-size is with the parallel flags")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per sparse feed-forward (0: dense)")
    g.add_argument("--moe-router-type", choices=ROUTER_TYPES, default=None,
                   help="switch: top-1 scaled by its probability; topk: --moe-router-topk "
                        "experts, weights renormalised; base: BASE layers' best balanced "
                        "assignment, greedy top-1 in evaluation; cpm2: CPM-2-MoE's BASE layers "
                        "as it ran them (frozen centroids, its auction over the data-parallel "
                        "group, EP = DP). Default: the model config's (switch)")
    g.add_argument("--moe-router-topk", type=int, default=None,
                   help="k of the topk router (implies --moe-router-type topk); default 2")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="load-balancing loss coefficient (default 1e-2)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="router z-loss coefficient (default 1e-3)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="training capacity per expert and sequence: factor x k x length / "
                        "experts token choices, the rest dropped (default: dropless)")
    g.add_argument("--moe-eval-capacity-factor", type=float, default=None,
                   help="the same in evaluation (default: dropless)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_const", const=True,
                   default=None, help="auxiliary-loss-free balancing: a per-expert bias on the "
                   "choice, moved toward equal load after each step")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="the expert bias's step")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="router input jitter in training: times uniform [1 - eps, 1 + eps]")
    g.add_argument("--moe-encoder-sparse-step", type=int, default=None,
                   help="sparse encoder blocks: i %% step == 1, every block with 1 (Hugging "
                        "Face's encoder_sparse_step); 0: none")
    g.add_argument("--moe-decoder-sparse-step", type=int, default=None,
                   help="the same for the decoder")


def apply_moe_flags(t5: T5Config, flags: Mapping[str, Any]) -> Tuple[T5Config, List[str]]:
    """The model config with the MoE flags given applied; (config, problems naming flags)."""
    changes = {field_name: flags[dest] for dest, (field_name, _) in MOE_FLAGS.items()
               if flags.get(dest) is not None}
    if flags.get("moe_router_topk") is not None and flags.get("moe_router_type") is None:
        changes["router_type"] = "topk"
    if not changes:
        return t5, []
    try:
        return dataclasses.replace(t5, **changes), []
    except ConfigError as e:
        problems = str(e).removeprefix("invalid model config: ").split("; ")
    names = {field_name: flag for field_name, flag in MOE_FLAGS.values()}
    named = []
    for problem in problems:
        field_name = problem.split(" ", 1)[0]
        flag = names.get(field_name) if field_name in changes else None
        named.append(f"{flag}: {problem}" if flag else f"--model-config: {problem}")
    return t5, named


def moe_layout_problems(t5: T5Config, parallel, zero_stage: int, precision: str) -> List[str]:
    """The combinations a Mixture-of-Experts run refuses before it starts."""
    ep = parallel.expert_model_parallel_size
    out = []
    if not t5.is_moe:
        if ep > 1:
            out.append(f"--expert-model-parallel-size {ep} needs a Mixture-of-Experts model "
                       "(--num-experts or num_experts in the model config)")
        return out
    if t5.num_experts % ep:
        out.append(f"--num-experts {t5.num_experts} is not divisible by "
                   f"--expert-model-parallel-size {ep}")
    if zero_stage == 3:
        out.append("--zero-stage 3 cannot train a Mixture-of-Experts model (num_experts "
                   f"{t5.num_experts}): ZeRO-3 would partition each expert over ranks that do "
                   "not run it; use --zero-stage 1 or 2 (optimizer states and gradients "
                   "partitioned over the ranks holding the same experts)")
    if zero_stage == 0 and precision != "fp32":
        out.append(f"--zero-stage 0 with {precision} cannot train a Mixture-of-Experts model "
                   f"(num_experts {t5.num_experts}): DeepSpeed's {precision} optimizer "
                   "mixes the expert-parallel ranks' gradient norms; use --zero-stage 1 or 2")
    return out


def cpm2_layout_problems(t5: T5Config, parallel, micro_batch: Optional[int],
                         lengths: Mapping[str, Optional[int]]) -> List[str]:
    """Where the 'cpm2' router is defined (megatron/model/moe_cpm2.py): its routing pool is the
    whole data-parallel group, so the experts are split over all of it (EP = DP); every rank's
    tokens split into equal parts, a multiple of experts x local experts. `lengths`: flag ->
    sequence length (None: not known here)."""
    if not t5.is_moe or t5.router_type != "cpm2":
        return []
    out = []
    ep, dp = parallel.expert_model_parallel_size, parallel.data_parallel_size
    if ep != dp:
        out.append(f"--moe-router-type cpm2 routes over the whole data-parallel group, as "
                   f"CPM-2-MoE did (one expert per data-parallel rank): "
                   f"--expert-model-parallel-size ({ep}) must equal the data-parallel size "
                   f"({dp})")
        return out
    if t5.num_experts % ep:
        return out  # (moe_layout_problems says so)
    multiple = t5.num_experts * (t5.num_experts // ep)
    for flag, length in lengths.items():
        if micro_batch is None or length is None or micro_batch * length % multiple == 0:
            continue
        out.append(f"--moe-router-type cpm2: a rank's tokens, --micro-batch-size {micro_batch} x "
                   f"{flag} {length} = {micro_batch * length}, must be a multiple of experts "
                   f"x experts per rank = {t5.num_experts} x {t5.num_experts // ep} = {multiple} "
                   "(CPM-2's shuffle and assignment cut them into equal parts)")
    return out


def load_model_config(spec: str) -> T5Config:
    """--model-config: a JSON file (Hugging Face's config.json or CPM-2's) or a preset name.

    Raises:
        ConfigError: the file or preset cannot be read or describes no buildable model.
    """
    path = Path(spec)
    try:
        return T5Config.from_json(path) if path.suffix == ".json" or path.exists() \
            else load_preset(spec)
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def resolve_model(flags, tensor_parallel_size: int, pipeline_parallel_size: int,
                  checkpoint_activations: bool, expert_parallel_size: int = 1
                  ) -> Tuple[Optional[ModelConfig], List[str]]:
    """The model part of the run from the flags (`vars(namespace)`); (None, problems) when the
    model config cannot be read."""
    problems: List[str] = []
    if flags["make_vocab_size_divisible_by"] < 1:
        problems.append("--make-vocab-size-divisible-by must be >= 1")
    if flags["checkpoint_num_layers"] < 1:
        problems.append("--checkpoint-num-layers must be >= 1")
    if not 0 <= flags["label_smoothing"] < 1:
        problems.append("--label-smoothing must be in [0, 1)")
    spec = flags["model_config"]
    if spec is None:
        return None, problems
    try:
        t5 = load_model_config(spec)
    except ConfigError as e:
        where = "" if spec in str(e) else f" {spec}"
        return None, [f"--model-config{where}: {e}"] + problems
    t5, moe_problems = apply_moe_flags(t5, flags)
    problems += moe_problems
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    problems += [f"--tensor-model-parallel-size {tp}: {p}" for p in model_parallel_problems(t5, tp)]
    del pp  # the pipeline cut is checked by megatron/pipeline/partition.py
    rate = flags.get("moe_router_bias_update_rate", 1e-3)
    if rate is not None and rate <= 0:
        problems.append("--moe-router-bias-update-rate must be positive")
    return ModelConfig(t5, flags["make_vocab_size_divisible_by"], flags["attention_backend"],
                       checkpoint_activations, flags["checkpoint_num_layers"],
                       flags["label_smoothing"], rate, bool(flags.get("compile"))), problems
