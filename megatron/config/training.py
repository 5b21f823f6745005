"""The training settings of a run, one frozen dataclass per concern (the whole run is
megatron/config/__init__.py's RunConfig). Defaults live on the fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.config.lr_schedule import LRSchedule
from megatron.data.storage.object_storage import StorageSettings


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
    eval_log_samples: int = 0
    """Decoded examples (input, target, the model's greedy fill) of the first evaluation batch
    logged by rank 0 at each evaluation (0: none)."""


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
class DivergenceConfig:
    """The divergence guard (megatron/training/divergence.py): stop, without saving, a run whose
    loss and gradient norm are finite but that has diverged. A threshold of 0 turns its check
    off. Why the defaults never fire on healthy runs (measured with the guard's own numbers over
    the 300 steps of launch/quickstart.sh and every run of tests/training/test_training_equality,
    test_resume and test_pipeline: ZeRO 0-3, offload, bf16, TP 2, PP 2):

    - weight_growth 2: Adam moves each weight by about the learning rate per step (exactly lr
      at the first step), so a tensor of root-mean-square w grows by about sqrt(1 + (lr / w)^2)
      per step, 1 + lr / w at worst. Measured: at most 1.013 (quickstart) and 1.005 (tests). A
      healthy 2 would need lr above w, e.g. 1e-2 on weights of rms 1e-2, far above what Adam
      trains T5 with. A learning rate that blows the model up multiplies norms by thousands in
      one step (--lr 1e6: 1e6 and more).
    - zero_grad_steps 2: a step with labelled tokens always gives some parameter a gradient;
      measured: no exact 0 in any of those steps. A diverged model's norm can be exactly 0 (its
      activations saturate; the logits all equal, the loss stuck at ln(vocabulary)). Two in a
      row, so that an engine reporting 0 for a norm it did not compute cannot stop a run; fp16
      steps that overflowed (DeepSpeed skips them) are not counted.
    - loss_spike_factor 3 over loss_window 100: measured, no step's loss was above 1.09 times
      the mean of the previous 100 (1.14 times the previous step's). A diverged run's loss jumps
      to ln(vocabulary) or beyond, 3 to 5 times a trained model's. While the loss falls fast,
      the running mean lags above it, which only loosens the check.
    """

    enabled: bool = True
    """--check-for-divergence (default on); False turns every check off."""
    loss_spike_factor: float = 3.0
    """Stop when a step's loss is more than this many times the mean of the previous
    `loss_window` steps' losses (0: off)."""
    loss_window: int = 100
    """Steps in the running mean; the spike check starts once that many steps of this start
    have been seen (a resumed run starts a fresh window)."""
    zero_grad_steps: int = 2
    """Stop after this many consecutive steps whose gradient norm is exactly 0 (0: off)."""
    weight_growth: float = 2.0
    """Stop when the norm of a weight tensor (a rank's part of it) grows by more than this factor
    in one step (0: off)."""

    @property
    def judges_next_step(self) -> bool:
        """Whether a check reads a step's loss or gradient norm, which judge the weights of the
        step before (so a save waits for the next step: megatron/checkpoint/io/saver.py)."""
        return self.enabled and (self.loss_spike_factor > 0 or self.zero_grad_steps > 0)


@dataclass(frozen=True)
class CheckpointStorage:
    """How an s3:// --save or --load is written and read (megatron/checkpoint/io/remote.py)."""

    settings: StorageSettings = StorageSettings()
    """The data's --object-storage-* settings (endpoint and credentials are boto3's)."""
    staging_path: Optional[str] = None
    """Node-local folder the files go through (--checkpoint-staging-path; None: a temporary
    folder)."""
    part_size_mb: int = 32
    """Multipart upload part size (--object-storage-part-size-mb)."""
    upload_concurrency: int = 16
    """Requests of one rank's upload or download at once (--object-storage-upload-concurrency)."""


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
    """Write checkpoint files in the background (megatron/checkpoint/io/saver.py)."""
    check_for_nan: bool = True
    """Stop, without saving, at a step whose loss or gradient norm is not finite."""
    detect_nan_layers: bool = False
    """Watch every module on every step (megatron/training/nan_locator.py), not only in a
    re-run of the failing step."""
    divergence: DivergenceConfig = DivergenceConfig()
    """Stop, without saving, at a step whose loss, gradient norm or weights show divergence."""
    ckpt_step: Optional[int] = None
    """The iteration of `load` to load (--ckpt-step); None: the one its tracker names."""
    storage: CheckpointStorage = CheckpointStorage()
    """How an s3:// `save` or `load` is written and read."""

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


@dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = False
    """--profile."""
    step_start: int = 10
    """Start recording at the boundary where the run has done this many steps."""
    step_end: int = 12
    """Stop (and write the trace) at the boundary where it has done this many."""
    ranks: Tuple[int, ...] = (0,)
    """Global ranks that record."""
    folder: Optional[str] = None
    """Where the traces go: SAVE/profile."""
