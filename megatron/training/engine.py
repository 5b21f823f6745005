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

from typing import Dict, List, Optional

import torch

from megatron import deepspeed_internals, parallel_state
from megatron.config.prompt_args import PromptSettings
from megatron.config.training import OptimizerConfig, ZeroConfig
from megatron.model.settings import ModelConfig
from megatron.model.t5 import T5Model, compile_blocks
from megatron.training import experts
from megatron.training.prompt_tuning import prepare_model

NO_DECAY_MARKERS = ("layer_norm", "bias", "relative_attention_bias")


def build_model(model: ModelConfig, zero: ZeroConfig, device: torch.device,
                ds_json: Dict, prompt: Optional[PromptSettings] = None) -> T5Model:
    """The model for this rank (weights identical on every data-parallel rank).

    ds_json: DeepSpeed's config, read by zero.Init under ZeRO-3.
    prompt: prompt tuning's settings: the prompt attached, the rest frozen (the optimizer
        takes only what requires a gradient: `param_groups`)."""
    # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
    import deepspeed

    def make(device=None):
        built = T5Model(model.t5,
                        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
                        attention_backend=model.attention_backend,
                        checkpoint_activations=model.checkpoint_activations,
                        checkpoint_num_layers=model.checkpoint_num_layers,
                        label_smoothing=model.label_smoothing, device=device)
        if prompt is not None:
            prepare_model(built, prompt)
        return built

    if zero.stage == 3:
        remote = None if zero.offload_param == "none" else zero.offload_param
        with deepspeed.zero.Init(data_parallel_group=parallel_state.get_data_parallel_group(),
                                 remote_device=remote, config_dict_or_path=ds_json,
                                 pin_memory=device.type == "cuda",
                                 mpu=parallel_state):
            built = make(device)
    else:
        built = make(device)
        experts.prepare(built)  # expert parallelism on DeepSpeed's conventions
    if model.compile:
        compile_blocks(built)
    return built


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


def build_optimizer(config: OptimizerConfig, offload_optimizer: str, device_type: str,
                    model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = experts.split_param_groups(model, param_groups(model, config.weight_decay))
    betas = (config.adam_beta1, config.adam_beta2)
    if offload_optimizer != "none":
        # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        with deepspeed_internals.deepspeed_op_build_env():  # its op is built on first use
            return DeepSpeedCPUAdam(groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                                    weight_decay=config.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                             weight_decay=config.weight_decay,
                             fused=True if device_type == "cuda" else None)


def initialize_engine(optimizer: OptimizerConfig, zero: ZeroConfig, device_type: str,
                      ds_json: Dict, model: torch.nn.Module):
    """(engine, optimizer): DeepSpeed wrapped around the model and our AdamW."""
    # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
    import deepspeed

    adamw = build_optimizer(optimizer, zero.offload_optimizer, device_type, model)
    if zero.stage == 0 and experts.uses_deepspeed_experts(model):
        ds_json = {**ds_json, "gradient_clipping": 0.0}  # the step clips (experts.py)
    with deepspeed_internals.deepspeed_op_build_env():  # NVMe offload builds its aio op
        engine, adamw, _, _ = deepspeed.initialize(model=model, optimizer=adamw,
                                                   config=ds_json, mpu=parallel_state,
                                                   dist_init_required=False)
    return engine, adamw


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters this rank holds (ZeRO-3's partitioned ones by their full size)."""
    return sum(deepspeed_internals.full_numel(p) for p in model.parameters())
