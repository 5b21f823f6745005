"""Flags of `megatron.pretrain_t5` that contradict each other or change nothing, and path flags
with a scheme they do not support: found before start, each naming its flags.

"Given" is what the command line set (megatron/config/given_flags.py), not a value that differs
from the default: `--max-ngram 10` changes nothing under span corruption though 10 is the
default. docs/training.md "Checked before start" lists these.
"""

from __future__ import annotations

from typing import Iterable, List, Mapping, Optional, Set

from megatron.config.given_flags import alias_problems, spellings
from megatron.data.data_args import DATA_PATH_FLAGS
from megatron.data.datasets.ul2 import DEFAULT_MODE_TOKENS
from megatron.data.storage.paths import path_flag_problems
from megatron.model.settings import MOE_FLAGS

LOCAL = ()
PATH_FLAGS = {
    **DATA_PATH_FLAGS,
    "model_config": ("--model-config", LOCAL),
    "deepspeed_config": ("--deepspeed_config", LOCAL),
    "nvme_path": ("--nvme-path", LOCAL),
    "save": ("--save", ("s3",)),  # megatron/checkpoint/io/remote.py
    "load": ("--load", ("s3",)),
    "prompt_load": ("--prompt-load", ("s3",)),  # megatron/training/prompt_tuning.py
    "tensorboard_dir": ("--tensorboard-dir", LOCAL),
    "log_file": ("--log-file", LOCAL),
}
"""Every path flag of the entry point: dest -> (flag, the URL schemes it supports)."""

UL2_ONLY = ("ul2_denoisers", "ul2_s_prefix", "ul2_sample_layout", "ul2_no_mode_tokens") + \
    tuple(f"ul2_{kind.lower()}_denoiser_token" for kind in DEFAULT_MODE_TOKENS)
SPAN_NOISE = ("noise_density", "mean_noise_span_length", "whole_word_masking")
"""Span corruption's noise: UL2's denoisers set their own."""
OBJECT_STORAGE = ("object_storage_cache_path", "object_storage_read_ahead",
                  "object_storage_block_cache_mib", "object_storage_max_connections",
                  "object_storage_retries", "object_storage_timeout", "object_storage_reader")


def command_line_problems(values: Mapping[str, object], given: Set[str], t5=None) -> List[str]:
    """Aliases given with different values, flags that would change nothing, path flags with an
    unsupported scheme. `given`: the destinations the command line set; `t5`: the model's
    config with the MoE flags applied (None: unknown, the MoE flags are not checked)."""
    names = spellings(values)
    flag = lambda dest: names.get(dest, "--" + dest.replace("_", "-"))  # noqa: E731
    problems = alias_problems(values)
    problems += path_flag_problems(values, PATH_FLAGS)
    problems += objective_flag_problems(values, given, flag)
    problems += object_storage_flag_problems(values, given, flag)
    if t5 is not None:
        problems += moe_flag_problems(t5, values, given, flag)
    return problems


def objective_flag_problems(values: Mapping[str, object], given: Set[str],
                            flag=None) -> List[str]:
    """The data flags of one objective given with another (also data_tools/build_indices.py's).
    `flag`: dest -> the spelling to name (default: the dest's)."""
    flag = flag or (lambda dest: spellings(values).get(dest, "--" + dest.replace("_", "-")))
    objective = "seq2seq" if values.get("finetune_data") is not None \
        else values.get("t5_objective")
    out = []
    if objective != "ul2":
        out += _only(given, UL2_ONLY, flag, f"with --t5-objective ul2 (this run's objective is "
                                            f"{objective})")
    else:
        out += [f"{flag(d)} has no effect with --t5-objective ul2: its denoisers set the "
                f"noise (--ul2-denoisers)" for d in SPAN_NOISE if d in given]
        if values.get("ul2_no_mode_tokens"):
            out += [f"{flag(d)} has no effect with --ul2-no-mode-tokens (no mode token is "
                    f"prepended)" for d in UL2_ONLY[4:] if d in given]
    if objective != "megatron" and "max_ngram" in given:
        out.append(f"--max-ngram has effect only with --t5-objective megatron (this run's "
                   f"objective is {objective})")
    megatron_rows = objective == "megatron" or (
        objective == "ul2" and values.get("ul2_sample_layout") == "megatron")
    if not megatron_rows and "short_seq_prob" in given:
        out.append("--short-seq-prob has effect only with --t5-objective megatron or with "
                   "--t5-objective ul2 --ul2-sample-layout megatron")
    return out


def object_storage_flag_problems(values: Mapping[str, object], given: Set[str],
                                 flag) -> List[str]:
    """--object-storage-* flags with no s3:// data to read and no s3:// checkpoint."""
    data = values.get("data_path") or ()
    if any(str(entry).startswith("s3://") for entry in
           [*data, *(values.get(d) or "" for d in ("save", "load", "prompt_load"))]):
        return []
    return _only(given, OBJECT_STORAGE, flag, "with s3:// data or an s3:// --save / --load / "
                                              "--prompt-load (--data-path, --save, --load and "
                                              "--prompt-load name none)")


def moe_flag_problems(t5, values: Mapping[str, object], given: Set[str], flag) -> List[str]:
    """MoE flags on a dense model, and the top-k router's k with another router. The flags
    given decide over `t5` (the model config, which keeps its own values where the flags
    make it invalid: that is reported by the model's checks)."""
    moe = tuple(MOE_FLAGS) + ("moe_router_bias_update_rate",)
    experts = values.get("num_experts") if "num_experts" in given else t5.num_experts
    if not experts:
        return _only(given, [d for d in moe if d != "num_experts"], flag,
                     "on a Mixture-of-Experts model (num_experts is 0: set --num-experts or "
                     "num_experts in --model-config)")
    router = values.get("moe_router_type") or (
        "topk" if "moe_router_topk" in given else t5.router_type)
    out = []
    if "moe_router_topk" in given and router != "topk":
        out.append(f"--moe-router-topk {values['moe_router_topk']} has effect only with "
                   f"--moe-router-type topk (the {router} router sends each token to one "
                   f"expert)")
    if "moe_router_bias_update_rate" in given and not (
            values.get("moe_router_enable_expert_bias") or t5.moe_expert_bias):
        out.append("--moe-router-bias-update-rate has effect only with "
                   "--moe-router-enable-expert-bias")
    return out


def _only(given: Set[str], dests: Iterable[str], flag, condition: str) -> List[str]:
    return [f"{flag(d)} has effect only {condition}" for d in dests if d in given]


def defaults_of(parser) -> Mapping[str, Optional[object]]:
    """dest -> default of every flag of `parser` (given_dests' fallback)."""
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}
