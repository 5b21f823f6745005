"""How a run builds the model: the architecture (T5Config) and the build options, and the
checks of the model flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from megatron.model.config import ConfigError, T5Config, load_preset
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
                  checkpoint_activations: bool) -> Tuple[Optional[ModelConfig], List[str]]:
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
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    problems += [f"--tensor-model-parallel-size {tp}: {p}" for p in model_parallel_problems(t5, tp)]
    del pp  # the pipeline cut is checked by megatron/pipeline/partition.py
    return ModelConfig(t5, flags["make_vocab_size_divisible_by"], flags["attention_backend"],
                       checkpoint_activations, flags["checkpoint_num_layers"],
                       flags["label_smoothing"]), problems
