"""T5Config: the architecture of a T5 / T5 v1.1 / CPM-2 encoder-decoder, read from JSON.

A Hugging Face T5 `config.json` and a CPM-2 model config both load as they are. Every field that
shapes the model is honoured; keys that only describe a Hugging Face checkpoint (its class name,
library version, generation defaults) are accepted and listed in `HF_METADATA_KEYS`; any other key
is an error that names the file and the key, so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish")
INIT_METHODS = ("t5x", "hf", "cpm2")

# Keys of Hugging Face config.json files that do not change the architecture we build.
HF_METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
    "dtype", "use_cache", "is_encoder_decoder", "n_positions", "output_past",
    "task_specific_params", "tokenizer_class", "gradient_checkpointing", "classifier_dropout",
    "is_gated_act", "dense_act_fn", "is_decoder", "bos_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "max_position_embeddings",  # CPM-2 writes it; T5 positions are relative buckets
    "add_router_probs", "add_cross_attention", "chunk_size_feed_forward",  # SwitchTransformers
})

ROUTER_TYPES = ("switch", "topk", "base", "cpm2")
"""The routers of megatron/model/moe.py and moe_cpm2.py."""

CPM2_OFF_KEYS = {"do_dim_trick": False, "attn_scale": False}
"""CPM-2 switches accepted at these values only (the architecture they change is not built)."""


MOE_FIELDS = ("num_experts", "encoder_sparse_step", "decoder_sparse_step",
              "num_sparse_encoder_layers", "num_sparse_decoder_layers", "router_type",
              "router_topk", "expert_capacity", "expert_capacity_factor",
              "eval_expert_capacity_factor", "router_bias", "router_jitter_noise", "router_dtype",
              "router_ignore_padding_tokens", "router_z_loss_coef", "router_aux_loss_coef",
              "moe_expert_bias", "router_centroid_gain")
"""The Mixture-of-Experts fields (left out of a dense model's dict)."""


class ConfigError(ValueError):
    """A model configuration that cannot be built; the message names the file and key.

    problems: (field, message) for each invalid field where the values were checked
        (`T5Config.validate`), so that a caller names them its own way (a tool's flag) without
        parsing the message; empty otherwise. field: the first one's field (None: none)."""

    def __init__(self, message: str, problems: Sequence[Tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.problems: List[Tuple[str, str]] = list(problems)
        self.field: Optional[str] = self.problems[0][0] if self.problems else None


@dataclass
class T5Config:
    """The architecture. Field names are Hugging Face's (CPM-2 uses the same ones)."""

    vocab_size: int = 32128
    """Token ids the tokenizer produces (sentinels included); the embedding table is padded."""
    d_model: int = 512
    """Width of the residual stream."""
    d_kv: int = 64
    """Width of one attention head (d_model need not equal num_heads * d_kv)."""
    d_ff: int = 2048
    """Inner width of the feed-forward block."""
    num_layers: int = 6
    """Encoder blocks."""
    num_decoder_layers: Optional[int] = None
    """Decoder blocks; None means num_layers."""
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    """'relu' (T5 v1.0), 'gated-gelu' (T5 v1.1, CPM-2: tanh GELU), or [gated-]{relu,gelu,silu}."""
    tie_word_embeddings: bool = True
    """True: the LM head is the input embedding (T5 v1.0). False: a separate lm_head (T5 v1.1,
    mT5, CPM-2). Hugging Face 5.x writes true for every T5; for its checkpoints the tensors
    decide, as in its from_pretrained (`state_dict.from_hf_checkpoint`)."""
    scale_decoder_outputs: Optional[bool] = None
    """Multiply the decoder output by d_model ** -0.5 before the LM head. None: as
    tie_word_embeddings (T5 v1.0 scales, v1.1 does not). Hugging Face 5.x writes it into
    config.json; it is honoured as written."""
    initializer_factor: float = 1.0
    """Scales the standard deviations of init_method 't5x' and 'hf'."""
    init_method: Optional[str] = None
    """How a model built from scratch draws its weights (a loaded checkpoint overwrites them):
    't5x': the recipe that pretrained T5 and T5 v1.1 (Mesh TensorFlow, as t5x rebuilds it):
    variance scaling over each layer's fan-in, so an untied lm_head starts with std
    d_model ** -0.5 and the first loss is near ln(vocab_size).
    'hf': Hugging Face's, the same except an untied lm_head with std 1.0 (first logits about
    sqrt(d_model) large, a first loss several times ln(vocab_size)) and the relative attention
    bias (std d_model ** -0.5).
    'cpm2': normal with init_method_std, output layers scaled by 1/sqrt(2 * layers).
    None: 'cpm2' when the file sets init_method_std, else 't5x'. Per layer:
    megatron/model/transformer.py, InitMethods."""
    init_method_std: float = 0.02
    use_scaled_init_for_output_weights: bool = True
    """init_method 'cpm2': divide the output projections' std by sqrt(2 * layers) (CPM-2)."""
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    # Mixture-of-Experts (megatron/model/moe.py); names as Hugging Face's SwitchTransformersConfig
    num_experts: int = 0
    """Experts of each sparse feed-forward; 0: a dense model."""
    encoder_sparse_step: int = 1
    """Which encoder blocks are sparse, as Hugging Face counts: with step s, blocks i with
    i % s == 1, or every block when s == 1 (Switch: 2, every second block; CPM-2-MoE: 1);
    0: none."""
    decoder_sparse_step: int = 1
    """The same for the decoder."""
    num_sparse_encoder_layers: Optional[int] = None
    """Hugging Face's: when given without encoder_sparse_step, the step is
    num_layers // num_sparse_encoder_layers (num_layers when 0)."""
    num_sparse_decoder_layers: Optional[int] = None
    router_type: str = "switch"
    """'switch' (top-1, output scaled by its probability), 'topk' (router_topk experts, weights
    renormalised), 'base' (balanced assignment in training, greedy top-1 in evaluation) or
    'cpm2' (CPM-2-MoE's BASE layers: frozen random centroids, CPM-2's auction over the whole
    data-parallel group, no gate; megatron/model/moe_cpm2.py)."""
    router_topk: int = 2
    """k of router_type 'topk'."""
    expert_capacity: Optional[int] = None
    """Hugging Face's: the token choices an expert takes per sequence, used when no capacity
    factor is set; None: dropless."""
    expert_capacity_factor: Optional[float] = None
    """Training capacity: ceil(factor x k x length / experts) choices per expert and sequence,
    the rest dropped; None: expert_capacity (dropless when that is None too)."""
    eval_expert_capacity_factor: Optional[float] = None
    """The same in evaluation (None: expert_capacity, dropless when None)."""
    router_bias: bool = False
    router_jitter_noise: float = 0.0
    """Training: the router's input times uniform noise in [1 - j, 1 + j]."""
    router_dtype: str = "float32"
    """Only float32: the router is always computed in float32."""
    router_ignore_padding_tokens: bool = False
    """Only false (as Hugging Face, which does not use it either)."""
    router_z_loss_coef: float = 1e-3
    router_aux_loss_coef: float = 1e-2
    router_centroid_gain: float = 0.1
    """router_type 'cpm2': the gain of the orthogonal initialisation of the frozen centroids
    (CPM-2's BaseLayer: 0.1; its init_ckpt.py upcycling: 0.01)."""
    moe_expert_bias: bool = False
    """Auxiliary-loss-free balancing: a per-expert bias on the choice, moved after each step."""

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.init_method is None:
            self.init_method = "t5x"
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = self.tie_word_embeddings
        self.validate()

    # Mixture-of-Experts -----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def sparse_blocks(self, is_decoder: bool) -> list:
        """The indices of a stack's sparse blocks (Hugging Face's rule, encoder_sparse_step)."""
        if not self.is_moe:
            return []
        step = self.decoder_sparse_step if is_decoder else self.encoder_sparse_step
        layers = self.num_decoder_layers if is_decoder else self.num_layers
        if step <= 0:
            return []
        return [i for i in range(layers) if step == 1 or i % step == 1]

    @property
    def has_balancing_losses(self) -> bool:
        """The sparse blocks add Switch's balancing and z-losses (not BASE layers: 'base', 'cpm2')."""
        return self.is_moe and self.router_type not in ("base", "cpm2")

    @property
    def router_k(self) -> int:
        """Experts per token."""
        return self.router_topk if self.router_type == "topk" else 1

    # Derived properties -----------------------------------------------------------------------
    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def activation(self) -> str:
        """The activation's name; 'gated-gelu' means the tanh GELU, as in Hugging Face."""
        if self.feed_forward_proj == "gated-gelu":
            return "gelu_new"
        return self.feed_forward_proj.split("-")[-1]

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    def padded_vocab_size(self, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
        """The embedding rows: vocab_size rounded up to a multiple of divisible_by x TP."""
        multiple = divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    # Validation -------------------------------------------------------------------------------
    def problems(self) -> list:
        """Every problem with the values, as messages; empty when the config is buildable."""
        return [message for _, message in self.field_problems()]

    def field_problems(self) -> List[Tuple[str, str]]:
        """Every problem with the values, as (the field, the message naming it)."""
        out = []
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
                     "num_heads", "relative_attention_num_buckets",
                     "relative_attention_max_distance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append((name, f"{name} must be a positive integer, not {value!r}"))
        for name in ("dropout_rate",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < 1:
                out.append((name, f"{name} must be in [0, 1), not {value!r}"))
        for name in ("layer_norm_epsilon", "initializer_factor", "init_method_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                out.append((name, f"{name} must be a positive number, not {value!r}"))
        parts = self.feed_forward_proj.split("-") if isinstance(self.feed_forward_proj, str) \
            else []
        if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") \
                or parts[-1] not in ACTIVATIONS:
            out.append(("feed_forward_proj",
                        f"feed_forward_proj {self.feed_forward_proj!r} is not one of relu, "
                        f"gated-gelu, or [gated-]{{{', '.join(ACTIVATIONS)}}}"))
        for name in ("tie_word_embeddings", "scale_decoder_outputs"):
            if not isinstance(getattr(self, name), bool):
                out.append((name, f"{name} must be true or false, not {getattr(self, name)!r}"))
        if self.init_method not in INIT_METHODS:
            out.append(("init_method", f"init_method must be one of "
                                       f"{', '.join(map(repr, INIT_METHODS))}, not "
                                       f"{self.init_method!r}"))
        if isinstance(self.relative_attention_num_buckets, int) \
                and self.relative_attention_num_buckets < 4:
            out.append(("relative_attention_num_buckets",
                        "relative_attention_num_buckets must be at least 4 (half exact, half "
                        "logarithmic, in each direction)"))
        for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if isinstance(value, int) and isinstance(self.vocab_size, int) \
                    and not 0 <= value < self.vocab_size:
                out.append((name, f"{name} {value} is outside the vocabulary (size "
                                  f"{self.vocab_size})"))
        return out + self.moe_field_problems()

    def moe_field_problems(self) -> List[Tuple[str, str]]:
        """What is wrong with the Mixture-of-Experts fields (nothing for a dense model), as
        (the field, the message naming it)."""
        out = []
        for name in ("num_experts", "encoder_sparse_step", "decoder_sparse_step", "router_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                out.append((name, f"{name} must be a non-negative integer, not {value!r}"))
        if out or not self.num_experts:
            return out
        if self.router_type not in ROUTER_TYPES:
            out.append(("router_type", f"router_type must be 'switch', 'topk', 'base' or "
                                       f"'cpm2', not {self.router_type!r}"))
        if self.router_type == "topk" and not 1 <= self.router_topk <= self.num_experts:
            out.append(("router_topk", f"router_topk ({self.router_topk}) must be between 1 and "
                                       f"num_experts ({self.num_experts})"))
        for name in ("expert_capacity_factor", "eval_expert_capacity_factor", "expert_capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float)) or value <= 0):
                out.append((name, f"{name} must be a positive number or null, not {value!r}"))
        if self.router_type in ("base", "cpm2"):
            kind = self.router_type
            for name in ("expert_capacity_factor", "eval_expert_capacity_factor"):
                if getattr(self, name) is not None:
                    out.append((name, f"{name} cannot be set with router_type '{kind}': BASE "
                                      "layers give every expert the same number of tokens, "
                                      "nothing is dropped"))
            if self.moe_expert_bias:
                out.append(("moe_expert_bias", f"moe_expert_bias cannot be set with router_type "
                                               f"'{kind}': its assignment is balanced already"))
        if self.router_type == "cpm2":
            for name in ("router_bias", "router_jitter_noise"):
                if getattr(self, name):
                    out.append((name, f"{name} cannot be set with router_type 'cpm2': CPM-2-MoE "
                                      "routes by fixed centroids (no router weights, no noise)"))
            gain = self.router_centroid_gain
            if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not gain > 0:
                out.append(("router_centroid_gain",
                            f"router_centroid_gain must be a positive number, not {gain!r}"))
        if self.router_dtype != "float32":
            out.append(("router_dtype", f"router_dtype {self.router_dtype!r} is not supported: "
                                        "the router is computed in float32"))
        if self.router_ignore_padding_tokens is not False:
            out.append(("router_ignore_padding_tokens",
                        "router_ignore_padding_tokens must be false"))
        if not isinstance(self.router_jitter_noise, (int, float)) \
                or not 0 <= self.router_jitter_noise < 1:
            out.append(("router_jitter_noise", f"router_jitter_noise must be in [0, 1), not "
                                               f"{self.router_jitter_noise!r}"))
        for name in ("router_z_loss_coef", "router_aux_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                out.append((name, f"{name} must be a non-negative number, not {value!r}"))
        return out

    def validate(self) -> None:
        """Raises:
            ConfigError: every problem (its `problems`: (field, message) pairs)."""
        problems = self.field_problems()
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(m for _, m in problems),
                              problems=problems)

    # I/O --------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Dict[str, Any], source: str = "model config") -> "T5Config":
        """Build from a dict of Hugging Face / CPM-2 fields; unknown keys are errors."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values
                   if k not in known and k not in HF_METADATA_KEYS and k not in CPM2_OFF_KEYS]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)}; known keys: "
                              f"{', '.join(sorted(known))}")
        problems = _metadata_problems(values)
        problems += [f"{key} {values[key]!r} (CPM-2) is not supported: only {off!r}"
                     for key, off in CPM2_OFF_KEYS.items() if values.get(key, off) != off]
        fields = {k: v for k, v in values.items() if k in known}
        if values.get("model_type") == "switch_transformers":
            fields.setdefault("feed_forward_proj", values.get("dense_act_fn", "relu"))
        for stack, layers in (("encoder", "num_layers"), ("decoder", "num_decoder_layers")):
            count = fields.get(f"num_sparse_{stack}_layers")
            if f"{stack}_sparse_step" not in fields and isinstance(count, int):
                total = fields.get(layers) or fields.get("num_layers", 6)
                fields[f"{stack}_sparse_step"] = total // count if count > 0 else total
        if "init_method" not in fields and "init_method_std" in fields:
            fields["init_method"] = "cpm2"
        try:
            config = cls(**fields)
        except ConfigError as err:
            problems.append(str(err).removeprefix("invalid model config: "))
            config = None
        except TypeError as err:
            problems.append(str(err))
            config = None
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        return config

    @classmethod
    def from_json(cls, path: Union[str, Path]) -> "T5Config":
        """Read a JSON file (Hugging Face config.json, CPM-2 model config or a preset)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"cannot read model config {path}: {err.strerror}") from None
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: "
                              f"{err.msg})") from None
        return cls.from_dict(values, source=str(path))

    def to_dict(self) -> Dict[str, Any]:
        """The fields; a dense model's leaves out the Mixture-of-Experts ones, a
        Mixture-of-Experts model's those of other routers (router_topk but for 'topk',
        router_centroid_gain but for 'cpm2')."""
        out = dataclasses.asdict(self)
        if not self.is_moe:
            for name in MOE_FIELDS:
                out.pop(name)
        else:  # a field that does not apply would contradict the model (--dry-run's k, say)
            if self.router_type != "cpm2":
                out.pop("router_centroid_gain")
            if self.router_type != "topk":  # one expert per token
                out.pop("router_topk")
        return out

    def to_hf_dict(self) -> Dict[str, Any]:
        """The fields of a Hugging Face T5 config.json for this architecture."""
        out = {k: v for k, v in self.to_dict().items()
               if k not in ("init_method", "init_method_std", "use_scaled_init_for_output_weights")}
        out.update(model_type="t5", architectures=["T5ForConditionalGeneration"],
                   is_encoder_decoder=True)
        return out


def _metadata_problems(values: Dict[str, Any]) -> list:
    """Metadata keys that contradict what we would build (another model type, say)."""
    out = []
    if values.get("model_type", "t5") not in ("t5", "mt5", "switch_transformers"):
        out.append(f"model_type {values['model_type']!r} is not a T5 model (t5, mt5 or "
                   "switch_transformers)")
    if values.get("is_encoder_decoder", True) is not True:
        out.append("is_encoder_decoder is false: only encoder-decoder models are built here")
    if values.get("is_decoder", False) is not False:
        out.append("is_decoder is true: that is a decoder stack's config, not a whole model's")
    if "dense_act_fn" in values and "feed_forward_proj" in values:
        expected = T5Config(feed_forward_proj=values["feed_forward_proj"]).activation \
            if isinstance(values["feed_forward_proj"], str) else None
        if expected is not None and values["dense_act_fn"] != expected:
            out.append(f"dense_act_fn {values['dense_act_fn']!r} contradicts feed_forward_proj "
                       f"{values['feed_forward_proj']!r} (which means {expected!r})")
    return out


def load_preset(name: str) -> T5Config:
    """A preset from configs/model/ by name (t5-base, t5-v1_1-xl, cpm2-11b, ...) or a path."""
    path = Path(name)
    if not path.suffix:
        path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        raise ConfigError(f"no model config {name!r}; presets: {', '.join(names)}")
    return T5Config.from_json(path)


PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
