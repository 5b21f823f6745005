"""The model, its optimizer and the DeepSpeed engine around them.

- The model is built on every rank with the same seed; under ZeRO-3 inside `deepspeed.zero.Init`,
  partitioned over the data-parallel group only (each tensor rank keeps its own shard), with
  `remote_device` set by `--offload-param`.
- AdamW: no weight decay on norms, biases and the relative attention bias; DeepSpeedCPUAdam when
  optimizer states are offloaded, torch's AdamW otherwise (fused on CUDA).
- The engine gets our `parallel_state` as `mpu`, so gradients are reduced over the data-parallel
  group and the clipping norm is taken over the model-parallel shards.
"""

from __future__ import annotations

import argparse
from typing import Dict, List

import torch

from megatron import parallel_state
from megatron.model.t5 import T5Model

NO_DECAY_MARKERS = ("layer_norm", "bias", "relative_attention_bias")


def build_model(args: argparse.Namespace) -> T5Model:
    """The model for this rank (weights identical on every data-parallel rank)."""
    import deepspeed

    def make(device=None):
        return T5Model(args.model, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                       attention_backend=args.attention_backend,
                       checkpoint_activations=args.checkpoint_activations,
                       checkpoint_num_layers=args.checkpoint_num_layers,
                       label_smoothing=args.label_smoothing, device=device)

    device = torch.device("cuda", torch.cuda.current_device()) if args.device_type == "cuda" \
        else torch.device("cpu")
    if args.zero_stage == 3:
        remote = None if args.offload_param == "none" else args.offload_param
        with deepspeed.zero.Init(data_parallel_group=parallel_state.get_data_parallel_group(),
                                 remote_device=remote, config_dict_or_path=args.ds_config,
                                 pin_memory=args.device_type == "cuda",
                                 mpu=parallel_state):
            return make(device)
    return make(device)


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict]:
    """Two groups: with and without weight decay (norms, biases, relative position bias)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if any(m in name for m in NO_DECAY_MARKERS) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    if args.offload_optimizer != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=args.lr, betas=betas, eps=args.adam_eps,
                                weight_decay=args.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=args.lr, betas=betas, eps=args.adam_eps,
                             weight_decay=args.weight_decay,
                             fused=True if args.device_type == "cuda" else None)


def initialize_engine(args: argparse.Namespace, model: torch.nn.Module):
    """(engine, optimizer): DeepSpeed wrapped around the model and our AdamW."""
    import deepspeed

    optimizer = build_optimizer(args, model)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=args.ds_config, mpu=parallel_state,
                                                   dist_init_required=False)
    return engine, optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters this rank holds (ZeRO-3's partitioned ones by their full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
