"""Hugging Face SwitchTransformers folders for our Mixture-of-Experts models (hf.py writes and
reads the folder; this module holds what differs from a T5 one): config.json, the tensor names,
and what transformers' `SwitchTransformersForConditionalGeneration` cannot compute.

What transformers 5.x builds from a SwitchTransformers config.json (its
modeling_switch_transformers.py):
- Routing is Switch's only: top-1, the expert's output scaled by its softmax probability, at
  most `expert_capacity` tokens per expert and sequence (an int; it has no capacity factor and no
  dropless mode), in training and in evaluation alike. Our 'switch' router is that; our 'topk'
  (renormalised weights), 'base' (sigmoid of the chosen logit) and expert bias are not.
- Experts and dense feed-forwards have one `wi` (no gated `wi_0` / `wi_1`).
- The sparse blocks come from `num_sparse_encoder_layers` alone (its `encoder_sparse_step` is
  recomputed as num_layers // n, n = 0 meaning num_layers): block i is sparse when
  i % step == 1 or step == 1, none when step is 0 (n > num_layers). `switch_sparse_layers` finds
  the n that builds our blocks.
- The decoder output is scaled by d_model ** -0.5 exactly when `tie_word_embeddings` is true
  (it has no `scale_decoder_outputs`), and an untied model unties the stacks' `embed_tokens`
  too: they are written as copies of `shared.weight` (our reader drops them again).

config.json carries our own fields beside transformers' (`router_type`, `feed_forward_proj`, the
capacity factors, `moe_expert_bias`, the sparse steps; `router_topk` for a 'topk' router only:
SwitchTransformersConfig has no k, its routing is top-1): transformers keeps unknown keys as
attributes and ignores them, and `read_hf_config` gets our exact model back.
A dropless model (no capacity) is written with expert_capacity `DROPLESS_CAPACITY`, which reads
back as dropless.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron.model.config import T5Config

ARCHITECTURE = "SwitchTransformersForConditionalGeneration"
DROPLESS_CAPACITY = 2 ** 31 - 1
"""expert_capacity written for a dropless model: no sequence has as many tokens."""


def switch_sparse_layers(config: T5Config, decoder: bool) -> Optional[int]:
    """The num_sparse_{encoder,decoder}_layers that makes transformers build this stack's sparse
    blocks (module docstring), or None when no value does."""
    layers = config.num_decoder_layers if decoder else config.num_layers
    want = config.sparse_blocks(decoder)
    for count in range(layers + 2):
        step = layers // count if count > 0 else layers
        built = [i for i in range(layers) if step > 0 and (step == 1 or i % step == 1)]
        if built == want:
            return count
    return None


def export_problems(config: T5Config) -> Tuple[List[str], List[str]]:
    """(what a SwitchTransformers folder cannot hold at all, what transformers would compute
    differently from our model at inference); both empty for a model it reproduces."""
    never, inexact = [], []
    if config.is_gated_act:
        never.append(f"gated feed-forwards (feed_forward_proj {config.feed_forward_proj!r}): "
                     f"SwitchTransformers' experts and dense feed-forwards have one wi, no "
                     f"wi_0 / wi_1")
    if config.scale_decoder_outputs != config.tie_word_embeddings:
        never.append(f"scale_decoder_outputs {config.scale_decoder_outputs} with "
                     f"tie_word_embeddings {config.tie_word_embeddings}: SwitchTransformers "
                     f"scales the decoder output exactly when the head is tied")
    for decoder, stack in ((False, "encoder"), (True, "decoder")):
        if switch_sparse_layers(config, decoder) is None:
            never.append(f"the {stack}'s sparse blocks {config.sparse_blocks(decoder)}: no "
                         f"num_sparse_{stack}_layers builds them")
    if config.router_type == "topk":
        inexact.append(f"top-{config.router_topk} routing with renormalised weights "
                       f"(transformers routes each token to its top-1 expert, scaled by its "
                       f"probability)")
    if config.router_type == "cpm2":
        never.append("router_type 'cpm2' (CPM-2-MoE's BASE layers): its frozen centroids "
                     "(`mlp.router.expert_centroids`) and its assignment over the data-parallel "
                     "group have no SwitchTransformers counterpart; keep it in our format or "
                     "write CPM-2's (`--to cpm2`)")
    if config.router_type == "base":
        inexact.append("BASE routing (greedy top-1 in evaluation scaled by the sigmoid of its "
                       "logit; transformers scales by the softmax probability)")
    if config.moe_expert_bias:
        inexact.append("the expert biases on the choice (transformers has none; they are "
                       "written as `mlp.router.expert_bias`, which it reports as unexpected)")
    if config.eval_expert_capacity_factor is not None:
        inexact.append(f"the evaluation capacity factor {config.eval_expert_capacity_factor} "
                       f"(transformers takes a count per sequence, expert_capacity: written "
                       f"{_capacity(config)})")
    return never, inexact


def _capacity(config: T5Config) -> int:
    return DROPLESS_CAPACITY if config.expert_capacity is None else int(config.expert_capacity)


def training_differences(config: T5Config) -> List[str]:
    """What transformers would do differently when training the exported model."""
    out = []
    if config.expert_capacity_factor is not None:
        out.append(f"our training capacity factor {config.expert_capacity_factor}: transformers "
                   f"trains with expert_capacity {_capacity(config)} tokens per expert and "
                   f"sequence")
    if max(len(config.sparse_blocks(False)), len(config.sparse_blocks(True))) > 1:
        out.append("the balancing loss of a stack with several sparse blocks: transformers "
                   "averages the routing fractions and probabilities over its blocks before "
                   "their product, we average the blocks' losses")
    return out


def switch_config_dict(config: T5Config, dtype_name: Optional[str] = None) -> Dict:
    """config.json for a SwitchTransformersForConditionalGeneration of `config` (checked with
    `export_problems` first): transformers' fields and our own (module docstring)."""
    values = config.to_hf_dict()
    values.update(
        model_type="switch_transformers", architectures=[ARCHITECTURE], is_encoder_decoder=True,
        use_cache=True, dense_act_fn=config.activation, expert_capacity=_capacity(config),
        num_sparse_encoder_layers=switch_sparse_layers(config, False),
        num_sparse_decoder_layers=switch_sparse_layers(config, True),
        add_router_probs=False)
    if config.router_type != "topk":  # top-1 ('switch', 'base'): a k would contradict it
        values.pop("router_topk", None)
    if dtype_name is not None:  # "dtype" for transformers 5.x, "torch_dtype" for 4.x
        values["dtype"] = values["torch_dtype"] = dtype_name
    return dict(sorted(values.items()))


def switch_config_values(values: Dict) -> Dict:
    """A SwitchTransformers config.json's values for T5Config.from_dict: the sparse steps as
    transformers derives them (then num_sparse_*_layers is dropped: the steps say it all), and
    the dropless capacity read back as none."""
    out = dict(values)
    for stack, layers in (("encoder", "num_layers"), ("decoder", "num_decoder_layers")):
        count = out.pop(f"num_sparse_{stack}_layers", None)
        if f"{stack}_sparse_step" not in out and isinstance(count, int):
            total = out.get(layers) or out.get("num_layers", 6)
            out[f"{stack}_sparse_step"] = total // count if count > 0 else total
    if out.get("expert_capacity") == DROPLESS_CAPACITY:
        out["expert_capacity"] = None
    return out


def switch_tensors(named: Iterable[Tuple[str, torch.Tensor]], config: T5Config
                   ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Our (name, full tensor) stream under SwitchTransformers names: each stacked expert weight
    split into `mlp.experts.expert_{e}.{w}.weight` (views, no copies), a dense block's
    `DenseReluDense` as `mlp`, and for an untied model the stacks' `embed_tokens` copies."""
    for name, tensor in named:
        if ".mlp.experts." in name:
            prefix, _, weight = name.rpartition(".")
            for e in range(tensor.shape[0]):
                yield f"{prefix}.expert_{e}.{weight}.weight", tensor[e]
        elif ".DenseReluDense." in name:
            yield name.replace(".DenseReluDense.", ".mlp."), tensor
        else:
            yield name, tensor
            if name == "shared.weight" and not config.tie_word_embeddings:
                yield "encoder.embed_tokens.weight", tensor
                yield "decoder.embed_tokens.weight", tensor


def switch_readme(config: T5Config, inexact: List[str]) -> str:
    """The folder's README.md section on its Mixture-of-Experts model."""
    k = "top-1 (switch)" if config.router_type == "switch" else \
        f"{config.router_type} (k = {config.router_k})"
    lines = [
        "## Mixture-of-Experts",
        "",
        f"`{ARCHITECTURE}.from_pretrained` loads this folder: {config.num_experts} experts, "
        f"routing {k}, sparse encoder blocks {config.sparse_blocks(False)}, sparse decoder "
        f"blocks {config.sparse_blocks(True)}, expert capacity "
        + ("none (dropless; transformers reads "
           f"expert_capacity {DROPLESS_CAPACITY})" if config.expert_capacity is None
           else f"{config.expert_capacity} tokens per expert and sequence") + ".",
        "",
    ]
    if inexact:
        lines += ["**transformers does not compute this model exactly** (written with "
                  "--allow-inexact-hf). It differs in:", ""]
        lines += [f"- {item}" for item in inexact]
        lines += ["", "config.json keeps our own fields beside transformers', so "
                  "`convert_checkpoint.py --from hf` reads the exact model back.", ""]
    else:
        lines += ["transformers computes the same model as the trainer in evaluation (the "
                  "same logits, up to float rounding).", ""]
    training = training_differences(config)
    if training:
        lines += ["Training it with transformers differs in:", ""]
        lines += [f"- {item}" for item in training]
        lines.append("")
    return "\n".join(lines)
