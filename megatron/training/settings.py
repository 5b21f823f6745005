"""The training settings of a run, one frozen dataclass per concern (see megatron/config.py for
the whole). Defaults live on the fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.training.lr_schedule import LRSchedule


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = 1
    """Samples per data-parallel rank per forward."""
    global_batch_size: int = 1
    """Samples per optimizer step over all ranks."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per rank per optimizer step."""
    train_iters: int = 0
    """Optimizer steps of the run (--train-samples is converted to these)."""
    eval_interval: int = 1000
    """Steps between evaluations (0: never)."""
    eval_iters: int = 100
    """Global batches per evaluation."""


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled decay, none on norms and biases) and its learning-rate schedule."""

    lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clipping; 0 for none."""
    schedule: Optional[LRSchedule] = None
    """None only while the flags cannot run (validation reports why)."""


@dataclass(frozen=True)
class PrecisionConfig:
    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16' (16-bit: fp32 master weights in the optimizer)."""
    loss_scale: Optional[float] = None
    """fp16: a static scale; None is dynamic."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: Optional[float] = None
    loss_scale_window: Optional[int] = None
    hysteresis: Optional[int] = None


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    offload_optimizer: str = "none"
    """'none', 'cpu' or 'nvme'."""
    offload_param: str = "none"
    nvme_path: Optional[str] = None


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    """Load the weights only: iteration, samples, optimizer, RNG and LR schedule start fresh."""
    lr_policy: str = "check"
    """On load: 'check' (flags and checkpoint must agree), 'flags' or 'checkpoint'."""
    timeout_minutes: float = 30.0
    keep_last: Optional[int] = None
    """Keep the newest N checkpoints in `save` (None: all)."""
    async_save: bool = False
    """Write checkpoint files in the background (megatron/training/saver.py)."""
    check_for_nan: bool = True
    """Stop, without saving, at a step whose loss or gradient norm is not finite."""
    detect_nan_layers: bool = False
    """Watch every module on every step (megatron/training/nan_locator.py), not only in a
    re-run of the failing step."""

    @property
    def weights_only(self) -> bool:
        return self.finetune or self.no_load_optim


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    log_file: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    peak_tflops: Optional[float] = None
    """The device's peak for MFU; None: from the table of GPUs."""
    grad_norms_per_layer: bool = False
    """Log the gradient norm of each layer group every log_interval steps
    (megatron/training/layer_norms.py)."""
    plots: bool = True
    """Write the run's figures into SAVE/plots/ when a run with --save ends (--no-plots)."""
