"""The T5 / CPM-2 encoder-decoder model (knows nothing of DeepSpeed)."""

from megatron.model.config import ConfigError, T5Config, load_preset
from megatron.model.t5 import T5Model, T5Output

__all__ = ["ConfigError", "T5Config", "T5Model", "T5Output", "load_preset"]
