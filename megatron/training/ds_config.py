"""The DeepSpeed config: read from `--deepspeed_config`, cross-checked with the flags, or made
from the flags alone.

Every setting that both sides can express (micro and global batch, accumulation, clipping,
precision and loss scaling, Adam's hyperparameters, ZeRO stage and offload) is compared: a value
given on both sides must agree, else the problem names the flag, the JSON key and the file; a
value given on one side is taken by the other. The result is one complete config dict that
DeepSpeed's own config class has parsed, so its errors appear before any process starts.

The optimizer and LR schedule are always built by our code (AdamW without decay on norms and
biases, Megatron's schedules); an "optimizer" section only supplies hyperparameters and a
"scheduler" section is refused.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from megatron.config.training import OptimizerConfig, PrecisionConfig, ZeroConfig

EXTRA_KNOWN_KEYS = {"optimizer", "scheduler", "activation_checkpointing", "aio",
                    "flops_profiler", "autotuning", "zero_allow_untested_optimizer",
                    "zero_force_ds_cpu_optimizer", "bfloat16", "fp16", "bf16", "amp"}
"""Top-level keys DeepSpeed reads outside its main config class."""

NEVER_EVER = 2 ** 31 - 1  # DeepSpeed's own step printing: our loop logs

OPTIMIZER_DEFAULTS = {f.name: f.default for f in fields(OptimizerConfig)
                      if f.name in ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                                    "clip_grad")}
"""Defaults of the optimizer flags the JSON may also set (applied after the cross-check)."""


class _Layout:
    """What DeepSpeed's config class asks an `mpu` for, before any process group exists."""

    def __init__(self, data_parallel_size: int, model_parallel_size: int) -> None:
        self.dp, self.mp = data_parallel_size, model_parallel_size

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_model_parallel_world_size(self) -> int:
        return self.mp

    def get_data_parallel_group(self):
        return None


class _TrackingDict(dict):
    """Records which top-level keys DeepSpeed's config class looked at."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.seen.add(key)
        return super().__contains__(key)


def load_json(path: str, problems: List[str]) -> Optional[Dict[str, Any]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        problems.append(f"--deepspeed_config {path}: cannot be read ({e.strerror or e})")
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        problems.append(f"--deepspeed_config {path}: line {e.lineno} column {e.colno}: {e.msg}")
        return None
    if not isinstance(data, dict):
        problems.append(f"--deepspeed_config {path}: the top level must be a JSON object")
        return None
    return data


class _Merge:
    """Cross-checks one flag against one JSON value at a time.

    `values` starts as the flags as parsed and ends as the agreed ones (a flag left out takes the
    JSON's value); the parsed namespace itself is never written."""

    def __init__(self, values: Dict[str, Any], path: Optional[str], problems: List[str]):
        self.values, self.path, self.problems = values, path, problems

    def take(self, dest: str, flag: str, json_key: str, json_value: Any, same=None) -> Any:
        """The agreed value (the flag's or the JSON's); records a problem when both disagree."""
        mine = self.values[dest]
        if json_value is None:
            return mine
        if mine is None:
            self.values[dest] = json_value
            return json_value
        agree = same(mine, json_value) if same else mine == json_value
        if not agree:
            self.problems.append(f"{flag} {mine} contradicts {json_key}: {json_value} in "
                                 f"{self.path}; remove one or make them equal")
        return mine


def _close(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


@dataclass(frozen=True)
class Resolved:
    """What the flags and the DeepSpeed JSON agree on."""

    batch: BatchSizes
    precision: PrecisionConfig
    zero: ZeroConfig
    optimizer: OptimizerHyper
    checkpoint_activations: bool
    json: Dict[str, Any]
    """The config for deepspeed.initialize."""


@dataclass(frozen=True)
class BatchSizes:
    micro_batch_size: Optional[int]
    global_batch_size: Optional[int]
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class OptimizerHyper:
    lr: Optional[float]
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float


def resolve(flags: Mapping[str, Any], data_parallel_size: int, model_parallel_size: int,
            device_type: str) -> Tuple[Resolved, Dict[str, Any], List[str]]:
    """Cross-check the flags (`vars(namespace)`, not modified) with `--deepspeed_config`.

    Returns (the agreed settings, every flag with the JSON's values filled in, the problems).
    """
    problems: List[str] = []
    path = flags["deepspeed_config"]
    user = (load_json(path, problems) if path else {}) or {}
    values = dict(flags)
    merge = _Merge(values, path, problems)
    batch = resolve_batch(merge, user, data_parallel_size)
    precision, fp16, bf16 = resolve_precision(merge, user, device_type)
    optimizer = resolve_optimizer(merge, user)
    zero, zero_json = resolve_zero(merge, user, precision.precision,
                                   values["pipeline_model_parallel_size"])
    checkpoint_activations = resolve_activation_checkpointing(values, user, path, problems)
    config = build_json(user, batch, data_parallel_size, optimizer.clip_grad, zero_json,
                        precision.precision, fp16, bf16)
    if values["pipeline_model_parallel_size"] > 1:
        pipeline_json(config, user, path, precision.precision, zero.stage, problems)
    if not problems:
        problems += deepspeed_problems(config, user, path, data_parallel_size,
                                       model_parallel_size)
    values.update(micro_batch_size=batch.micro_batch_size,
                  global_batch_size=batch.global_batch_size,
                  gradient_accumulation_steps=batch.gradient_accumulation_steps,
                  precision=precision.precision, zero_stage=zero.stage,
                  offload_optimizer=zero.offload_optimizer, offload_param=zero.offload_param,
                  checkpoint_activations=checkpoint_activations,
                  **{k: getattr(optimizer, k) for k in OPTIMIZER_DEFAULTS})
    return (Resolved(batch, precision, zero, optimizer, checkpoint_activations, config), values,
            problems)


def resolve_batch(merge: _Merge, user: Dict[str, Any], dp: int) -> BatchSizes:
    """Micro batch, global batch and accumulation: one of each from flags and JSON, consistent
    with the data-parallel size."""
    problems, path = merge.problems, merge.path
    micro = merge.take("micro_batch_size", "--micro-batch-size", "train_micro_batch_size_per_gpu",
                       user.get("train_micro_batch_size_per_gpu"))
    accumulation = user.get("gradient_accumulation_steps")
    global_batch = merge.take("global_batch_size", "--global-batch-size", "train_batch_size",
                              user.get("train_batch_size"))
    if micro is None and global_batch:
        micro = global_batch // (dp * (accumulation or 1)) or None
    if micro is None:
        problems.append("set --micro-batch-size (or train_micro_batch_size_per_gpu in the "
                        "DeepSpeed JSON)")
    elif micro < 1:
        problems.append(f"--micro-batch-size {micro} must be positive")
    else:
        if global_batch is None:
            global_batch = micro * dp * (accumulation or 1)
        per_step = micro * dp
        if global_batch % per_step or global_batch < per_step:
            problems.append(f"--global-batch-size {global_batch} is not a positive "
                            f"multiple of --micro-batch-size {micro} x data-parallel size {dp}")
        else:
            needed = global_batch // per_step
            if accumulation is not None and accumulation != needed:
                problems.append(f"gradient_accumulation_steps: {accumulation} in {path} "
                                f"contradicts --global-batch-size {global_batch} / "
                                f"(--micro-batch-size {micro} x data-parallel size {dp}) = "
                                f"{needed}")
            accumulation = needed
    return BatchSizes(micro, global_batch, accumulation or 1)


def resolve_precision(merge: _Merge, user: Dict[str, Any], device_type: str
                      ) -> Tuple[PrecisionConfig, Dict[str, Any], Dict[str, Any]]:
    """fp32, bf16 or fp16 and the loss scaling; (settings, fp16 section, bf16 section)."""
    problems, values, path = merge.problems, merge.values, merge.path
    fp16 = dict(user.get("fp16") or {})
    bf16 = dict(user.get("bf16") or user.get("bfloat16") or {})
    if fp16.get("enabled") and values["fp16"] is None:
        values["fp16"] = True
    if bf16.get("enabled") and values["bf16"] is None:
        values["bf16"] = True
    if values["fp16"] and "enabled" in fp16 and not fp16["enabled"]:
        problems.append(f"--fp16 contradicts fp16.enabled: false in {path}")
    if values["bf16"] and "enabled" in bf16 and not bf16["enabled"]:
        problems.append(f"--bf16 contradicts bf16.enabled: false in {path}")
    if values["fp16"] and values["bf16"]:
        problems.append("--fp16 and --bf16 exclude each other (check the DeepSpeed JSON too)")
    precision = "fp16" if values["fp16"] else "bf16" if values["bf16"] else "fp32"
    scaling = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
               "hysteresis")
    if precision != "fp16":
        for dest in scaling:
            if values[dest] is not None:
                problems.append(f"--{dest.replace('_', '-')} has effect only with --fp16")
        return PrecisionConfig(precision), fp16, bf16
    scale = fp16.get("loss_scale")
    merge.take("loss_scale", "--loss-scale", "fp16.loss_scale",
               scale if scale not in (None, 0) else None, _close)
    power = fp16.get("initial_scale_power")
    merge.take("initial_loss_scale", "--initial-loss-scale", "fp16.initial_scale_power "
               "(as 2^power)", 2.0 ** power if power is not None else None, _close)
    merge.take("min_loss_scale", "--min-loss-scale", "fp16.min_loss_scale",
               fp16.get("min_loss_scale"), _close)
    merge.take("loss_scale_window", "--loss-scale-window", "fp16.loss_scale_window",
               fp16.get("loss_scale_window"))
    merge.take("hysteresis", "--hysteresis", "fp16.hysteresis", fp16.get("hysteresis"))
    initial = values["initial_loss_scale"] or PrecisionConfig.initial_loss_scale
    if initial <= 0 or not float(math.log2(initial)).is_integer():
        problems.append(f"--initial-loss-scale {initial} must be a power of 2")
    fp16.update(enabled=True, loss_scale=values["loss_scale"] or 0,
                initial_scale_power=int(math.log2(initial)) if initial > 0 else 32)
    for dest in ("min_loss_scale", "loss_scale_window", "hysteresis"):
        if values[dest] is not None:
            fp16[dest] = values[dest]
    if device_type == "cpu":
        problems.append("--fp16 needs a CUDA device (DeepSpeed refuses fp16 on CPU); use --bf16")
    return PrecisionConfig(precision, values["loss_scale"], initial, values["min_loss_scale"],
                           values["loss_scale_window"], values["hysteresis"]), fp16, bf16


def resolve_optimizer(merge: _Merge, user: Dict[str, Any]) -> OptimizerHyper:
    """Adam's hyperparameters and clipping from the flags and the JSON's optimizer section;
    defaults (OPTIMIZER_DEFAULTS) for what neither gives."""
    problems, values, path = merge.problems, merge.values, merge.path
    merge.take("clip_grad", "--clip-grad", "gradient_clipping", user.get("gradient_clipping"),
               _close)
    optimizer = user.get("optimizer")
    if optimizer is not None:
        kind = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else ""
        if kind not in ("adam", "adamw"):
            problems.append(f"optimizer.type {optimizer.get('type') if kind else optimizer!r} "
                            f"in {path}: only Adam / AdamW are supported")
        else:
            params = optimizer.get("params", {}) or {}
            betas = params.get("betas") or [None, None]
            merge.take("lr", "--lr", "optimizer.params.lr", params.get("lr"), _close)
            merge.take("adam_beta1", "--adam-beta1", "optimizer.params.betas[0]", betas[0], _close)
            merge.take("adam_beta2", "--adam-beta2", "optimizer.params.betas[1]", betas[1], _close)
            merge.take("adam_eps", "--adam-eps", "optimizer.params.eps", params.get("eps"), _close)
            merge.take("weight_decay", "--weight-decay", "optimizer.params.weight_decay",
                       params.get("weight_decay"), _close)
            if params.get("adam_w_mode") is False or (kind == "adam" and "adam_w_mode" not in
                                                      params and params.get("torch_adam")):
                problems.append(f"optimizer in {path} asks for Adam with L2 decay; the trainer "
                                f"uses AdamW (decoupled decay); drop adam_w_mode / torch_adam")
    if "scheduler" in user:
        problems.append(f"scheduler in {path}: the LR schedule comes from --lr, --min-lr, "
                        f"--lr-decay-style, --lr-warmup-*; remove the section")
    out = {k: default if values[k] is None else values[k]
           for k, default in OPTIMIZER_DEFAULTS.items()}
    if out["clip_grad"] < 0:
        problems.append("--clip-grad must be >= 0")
    if not (0 <= out["adam_beta1"] < 1 and 0 <= out["adam_beta2"] < 1) or out["adam_eps"] <= 0:
        problems.append("--adam-beta1/2 must be in [0, 1) and --adam-eps positive")
    if out["weight_decay"] < 0:
        problems.append("--weight-decay must be >= 0")
    return OptimizerHyper(lr=values["lr"], **out)


def resolve_zero(merge: _Merge, user: Dict[str, Any], precision: str, pipeline_size: int
                 ) -> Tuple[ZeroConfig, Dict[str, Any]]:
    """ZeRO stage and offload; (settings, the zero_optimization section)."""
    problems, values = merge.problems, merge.values
    zero = dict(user.get("zero_optimization") or {})
    stage = merge.take("zero_stage", "--zero-stage", "zero_optimization.stage", zero.get("stage"))
    stage = ZeroConfig.stage if stage is None else stage
    devices = {}
    for dest in ("offload_optimizer", "offload_param"):
        section = zero.get(dest) or {}
        legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_params"}[dest]
        device = section.get("device") if isinstance(section, dict) else None
        if device is None and zero.get(legacy):
            device = "cpu"
        merge.take(dest, f"--{dest.replace('_', '-')}", f"zero_optimization.{dest}.device", device)
        value = devices[dest] = values[dest] or "none"
        if value != "none":
            entry = dict(section) if isinstance(section, dict) else {}
            entry["device"] = value
            if value == "nvme":
                nvme = merge.take("nvme_path", "--nvme-path", f"zero_optimization.{dest}.nvme_path",
                                  entry.get("nvme_path"))
                if nvme is None:
                    problems.append(f"--{dest.replace('_', '-')} nvme needs --nvme-path")
                elif not Path(nvme).is_dir():
                    problems.append(f"--nvme-path {nvme}: no such folder")
                else:
                    entry["nvme_path"] = nvme
            zero.pop(legacy, None)
            zero[dest] = entry
    offload_optimizer, offload_param = devices["offload_optimizer"], devices["offload_param"]
    if offload_param != "none" and stage != 3:
        problems.append(f"--offload-param {offload_param} needs --zero-stage 3 (have {stage})")
    if offload_optimizer == "nvme" and stage != 3:
        problems.append(f"--offload-optimizer nvme needs --zero-stage 3 (have {stage})")
    if offload_optimizer == "cpu" and stage == 0:
        problems.append("--offload-optimizer cpu needs --zero-stage 1, 2 or 3 (have 0)")
    if values["nvme_path"] is not None and "nvme" not in (offload_optimizer, offload_param):
        problems.append("--nvme-path has effect only with --offload-optimizer/--offload-param "
                        "nvme")
    if precision == "bf16" and stage == 0:
        problems.append("--bf16 with ZeRO stage 0: DeepSpeed's bf16 path there distorts the "
                        "first update and the gradient norm; use --zero-stage 1 or higher")
    if pipeline_size > 1 and stage >= 2:
        problems.append(f"--pipeline-model-parallel-size {pipeline_size} with --zero-stage "
                        f"{stage} (or zero_optimization.stage): DeepSpeed's pipeline engine "
                        f"supports ZeRO stages 0 and 1 only; use --zero-stage 1")
    if pipeline_size > 1 and offload_param != "none":
        problems.append(f"--pipeline-model-parallel-size {pipeline_size} with --offload-param "
                        f"{offload_param}: parameter offload needs ZeRO-3, which the pipeline "
                        f"engine does not support")
    zero["stage"] = stage
    return ZeroConfig(stage, offload_optimizer, offload_param, values["nvme_path"]), zero


UNSUPPORTED_ACTIVATION_CHECKPOINTING = {
    "partition_activations": "partitioned activations assume every checkpointed tensor is "
    "equal across tensor ranks and empty inputs that are reused (the encoder output feeds "
    "every decoder chunk)",
    "contiguous_memory_optimization": "it needs partition_activations",
    "cpu_checkpointing": "it is not implemented by our recomputation",
    "synchronize_checkpoint_boundary": "it is not implemented by our recomputation",
    "profile": "it is not implemented by our recomputation",
}


def resolve_activation_checkpointing(values: Mapping[str, Any], user: Dict[str, Any],
                                     path: Optional[str], problems: List[str]) -> bool:
    """Whether blocks are recomputed; the JSON's activation_checkpointing section is checked
    against what our recomputation implements."""
    ac = user.get("activation_checkpointing") or {}
    unsupported = UNSUPPORTED_ACTIVATION_CHECKPOINTING
    for key in ac:
        if key not in unsupported and key != "number_checkpoints":
            problems.append(f"activation_checkpointing.{key} in {path}: unknown key")
    if ac.get("number_checkpoints") is not None:
        problems.append(f"activation_checkpointing.number_checkpoints in {path}: use "
                        f"--checkpoint-num-layers (blocks per recomputed chunk) instead")
    for key, why in unsupported.items():
        if ac.get(key):
            problems.append(f"activation_checkpointing.{key}: true in {path} is not supported: "
                            f"{why}; set it to false")
    if values["deepspeed_activation_checkpointing"]:
        if values["deepspeed_config"] is None:
            problems.append("--deepspeed-activation-checkpointing needs --deepspeed_config")
        return True
    return bool(values["checkpoint_activations"])


def pipeline_json(config: Dict[str, Any], user: Dict[str, Any], path: Optional[str],
                  precision: str, stage: int, problems: List[str]) -> None:
    """The pipeline engine's settings, written into `config`.

    - pipeline.pipe_partitioned / grad_partitioned false: DeepSpeed's partitioned transfers
      assume the first tensor of a stage's output is the only one needing a gradient (GPT's
      hidden state); ours carry the encoder output too, and tensor ranks need no split.
    - bf16 with ZeRO-1 accumulates gradients in fp32 (data_types.grad_accum_dtype), which puts
      the engine on its BF16 optimizer, the one that reduces pipeline gradients.
    """
    where = path or "the DeepSpeed config"
    pipeline = dict(user.get("pipeline") or {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.get(key):
            problems.append(f"pipeline.{key}: true in {where} is not supported with our "
                            f"encoder-decoder stages (they send the encoder output beside the "
                            f"hidden state); set it to false")
        pipeline[key] = False
    config["pipeline"] = pipeline
    if precision == "bf16" and stage == 1:
        types = dict(user.get("data_types") or {})
        accum = types.get("grad_accum_dtype")
        if accum not in (None, "fp32", "float32"):
            problems.append(f"data_types.grad_accum_dtype {accum!r} in {where} with --bf16, "
                            f"--zero-stage 1 and --pipeline-model-parallel-size > 1: gradients "
                            f"must accumulate in fp32; set it to \"fp32\"")
        types["grad_accum_dtype"] = "fp32"
        config["data_types"] = types


def build_json(user: Dict[str, Any], batch: BatchSizes, dp: int, clip_grad: float,
               zero: Dict[str, Any], precision: str, fp16: Dict[str, Any],
               bf16: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's config: the user's JSON with every agreed value written in (the optimizer and
    scheduler sections are ours to build)."""
    micro = batch.micro_batch_size or 1
    config = {k: v for k, v in user.items()
              if k not in ("optimizer", "scheduler", "bfloat16", "activation_checkpointing")}
    config.update(train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=batch.gradient_accumulation_steps,
                  train_batch_size=micro * dp * batch.gradient_accumulation_steps,
                  gradient_clipping=clip_grad, zero_optimization=zero,
                  zero_allow_untested_optimizer=True)
    config.setdefault("steps_per_print", NEVER_EVER)
    config["fp16"] = fp16 if precision == "fp16" else {"enabled": False}
    config["bf16"] = {**bf16, "enabled": precision == "bf16"}
    return config


def deepspeed_problems(config: Dict[str, Any], user: Dict[str, Any], path: Optional[str],
                       dp: int, mp: int) -> List[str]:
    """What DeepSpeed's own config class says, and the JSON keys nobody reads."""
    # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
    from deepspeed.runtime.config import DeepSpeedConfig

    where = path or "the generated DeepSpeed config"
    # Without deepspeed.comm initialized the class assumes one process: leave the batch
    # arithmetic (checked above) out of its view.
    tracked = _TrackingDict({k: v for k, v in config.items() if k != "train_batch_size"})
    try:
        DeepSpeedConfig(tracked, mpu=_Layout(dp, mp))
    except Exception as e:  # noqa: BLE001 - pydantic and assertion errors alike
        return [f"{where}: DeepSpeed rejects it: {_describe(e)}"]
    known = tracked.seen | EXTRA_KNOWN_KEYS
    problems = []
    for key in user:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}: unknown key {key!r}{hint}")
    return problems


PYDANTIC_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16",
                     "DeepSpeedBF16Config": "bf16", "TensorBoardConfig": "tensorboard",
                     "WandbConfig": "wandb", "CSVConfig": "csv_monitor", "CometConfig": "comet",
                     "CommsLoggerConfig": "comms_logger"}
"""The JSON section that each of DeepSpeed's pydantic config classes reads."""


def _describe(error: Exception) -> str:
    """DeepSpeed's error; a pydantic one as `section.key: message (got value)` per key, since
    pydantic names the class and the key inside it, not the JSON section."""
    title = getattr(error, "title", None)
    if not (title and callable(getattr(error, "errors", None))):
        return str(error).strip().replace("\n", "; ")
    section = PYDANTIC_SECTIONS.get(title, title)
    return "; ".join(f"{'.'.join([section, *map(str, e['loc'])])}: {e['msg']} "
                     f"(got {repr(e.get('input'))[:80]})" for e in error.errors())
