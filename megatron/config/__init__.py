"""The run configuration: what `megatron.arguments.validate` returns, typed and frozen.

It sits below training/ (which reads its parts) and imports nothing of it: the training
settings are in config/training.py, the learning-rate schedule in config/lr_schedule.py.

One small dataclass per concern; a module takes the part it needs (the loop the batch and
logging parts, the engine the optimizer, precision and ZeRO parts, the data builder the data
part), never the whole. Defaults live on the fields. The flags as given and resolved are kept as
plain JSON values in `RunConfig.flags` (for the log and a checkpoint's meta.json); nothing reads
settings from there.

    RunConfig
      parallel    ParallelConfig     world, tensor, pipeline and data-parallel sizes   (here)
      batch       BatchConfig        micro / global batch, accumulation, steps,        (config/
                                     evaluation                                          training.py)
      optimizer   OptimizerConfig    AdamW's hyperparameters, clipping, the LR schedule  (same)
      precision   PrecisionConfig    fp32 / bf16 / fp16 and loss scaling                 (same)
      zero        ZeroConfig         ZeRO stage and offload                              (same)
      checkpoint  CheckpointConfig   save / load and what a load restores                (same)
      logging     LoggingConfig      log interval, files, TensorBoard, peak TFLOP/s      (same)
      model       ModelConfig        the T5Config and how the model is built   (model/settings.py)
      data        DataSettings       datasets, tokenizer, loader workers     (data/data_args.py)
      runtime     RuntimeConfig      device, backend, seeds, deadlines, exit   (here)
                                     conditions
      deepspeed   dict               the JSON handed to deepspeed.initialize (copy before use)
      profile     ProfileConfig      --profile: steps and ranks traced                   (same)

`Layout` is the part that fixes what a rank holds (model, parallel sizes, batch, precision, ZeRO,
DeepSpeed's JSON, sequence lengths): what the memory estimate reads, for `--dry-run` from a
validated run and for the planner (megatron/plan) from flags alone, without data files
(`megatron.arguments.layout_from_flags`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.config.training import (
    BatchConfig,
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    PrecisionConfig,
    ProfileConfig,
    ZeroConfig,
)
from megatron.data.data_args import DataSettings
from megatron.model.settings import ModelConfig
from megatron.pipeline.partition import Cut, cut_model


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    """Processes in the job (WORLD_SIZE or SLURM_NTASKS)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    """world_size / (tensor x pipeline)."""
    pipeline_split_rank: Optional[int] = None
    """--pipeline-model-parallel-split-rank: the first decoder stage (None: cut by cost)."""
    expert_model_parallel_size: int = 1
    """--expert-model-parallel-size: the experts split over this many data-parallel ranks."""

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size


@dataclass(frozen=True)
class RuntimeConfig:
    device_type: str = "cpu"
    """'cuda' or 'cpu' (see megatron.initialize.choose_device)."""
    distributed_backend: str = "gloo"
    local_rank: Optional[int] = None
    seed: int = 1234
    distributed_timeout_minutes: float = 10.0
    data_timeout_minutes: float = 10.0
    data_cache_timeout_s: float = 3600.0
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    warnings: Tuple[str, ...] = ()
    """Said once at start (e.g. a backend that fell back)."""

    def torch_device(self):
        """This rank's device: the current CUDA device (set by initialize_distributed), or the
        CPU."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@dataclass(frozen=True)
class Layout:
    """What one rank holds and computes: the inputs of megatron/cost/memory.py."""

    parallel: ParallelConfig
    batch: BatchConfig
    precision: PrecisionConfig
    zero: ZeroConfig
    model: ModelConfig
    encoder_seq_length: int
    decoder_seq_length: int
    deepspeed: Dict[str, Any] = field(default_factory=dict)

    def pipeline_cut(self) -> Cut:
        """Which layers each pipeline stage runs (megatron/pipeline/partition.py)."""
        model, parallel = self.model, self.parallel
        return cut_model(model.t5, parallel.pipeline_model_parallel_size,
                         parallel.pipeline_split_rank, self.encoder_seq_length,
                         self.decoder_seq_length,
                         model.t5.padded_vocab_size(model.make_vocab_size_divisible_by,
                                                    parallel.tensor_model_parallel_size))


@dataclass(frozen=True)
class RunConfig:
    parallel: ParallelConfig
    batch: BatchConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    zero: ZeroConfig
    model: ModelConfig
    data: DataSettings
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    runtime: RuntimeConfig
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's JSON as resolved; `deepspeed_json()` hands out a copy."""
    flags: Dict[str, Any] = field(default_factory=dict)
    """Every flag, resolved, as plain JSON values: logged and written to meta.json."""
    dry_run: bool = False
    dry_run_device: str = "auto"
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """--profile: which steps and ranks write a profiler trace (training/profiling.py)."""

    def layout(self) -> Layout:
        return Layout(self.parallel, self.batch, self.precision, self.zero, self.model,
                      self.data.encoder_seq_length, self.data.decoder_seq_length, self.deepspeed)

    def pipeline_cut(self):
        """Which layers each pipeline stage runs (megatron/pipeline/partition.py)."""
        return self.layout().pipeline_cut()

    def deepspeed_json(self) -> Dict[str, Any]:
        """A copy of the DeepSpeed config (DeepSpeed may write into what it is given)."""
        return copy.deepcopy(self.deepspeed)
