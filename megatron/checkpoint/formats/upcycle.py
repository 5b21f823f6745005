"""Sparse upcycling: a dense T5's full tensors as those of a Mixture-of-Experts T5 that computes the
same function at its first step (`convert_checkpoint.py --to megatron --num-experts E`), as
CPM-2-MoE was initialised from CPM-2 (and as in Komatsuzaki et al., "Sparse Upcycling", 2022).

Every sparse block's experts are copies of that block's dense feed-forward (`DenseReluDense.wi`,
or `wi_0` / `wi_1`, and `wo`), stacked into `mlp.experts.*` [E, ...]; its router is new and zero
(`mlp.router.classifier.weight`, a bias when `router_bias`, the expert bias when
`moe_expert_bias`); every other tensor is the dense one. Dense blocks keep their feed-forward.

What the upcycled model computes at step 0, per sparse block: a zero router gives every expert
the logit 0, so the probability 1 / E, and every expert computes the dense FFN(x). Then
- 'topk' (k experts, weights renormalised to sum to 1): sum_k (1/E) / (k/E) FFN(x) = FFN(x):
  exactly the dense model (up to the rounding of the grouped matmul), as long as nothing is
  dropped (dropless, or a capacity that holds every choice). Which k experts a token picks is
  torch's tie-break of equal scores: every token goes to the same k experts at first, and the
  router learns to spread them from the balancing loss's gradient (the language-model loss gives
  it none at step 0: the output does not depend on the router then).
- 'switch' (top-1 scaled by its probability): FFN(x) / E, the feed-forward scaled down E times.
- 'base' (scaled by the sigmoid of the chosen logit): FFN(x) / 2.
- 'cpm2' (CPM-2-MoE's BASE layer, as its init_ckpt.py): the router is not zero but E orthogonal
  centroids [E, d_model] of norm `centroid_gain` (theirs 0.01; torch's orthogonal_, drawn in
  fp32 from a fixed seed, then cast to the source's dtype), which CPM-2-MoE never trains; each
  token gets one expert, unscaled, so the upcycled model computes the dense one exactly.
The balancing losses at step 0: z-loss (ln E)^2 exactly, auxiliary loss k (each token's k choices
over a uniform router) before their coefficients; the objective is the dense loss plus those.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Iterator, Mapping, Optional, Tuple

import torch

from megatron.model.config import ConfigError, T5Config
from megatron.model.meta import buffer_shapes, full_parameter_shapes
from megatron.model.state_dict import feed_forward_prefix

UPCYCLE_FLAGS = {
    # the convert tool's flag (the trainer's name, megatron/model/settings.py) -> T5Config field
    "--num-experts": "num_experts",
    "--moe-router-type": "router_type",
    "--moe-router-topk": "router_topk",
    "--moe-encoder-sparse-step": "encoder_sparse_step",
    "--moe-decoder-sparse-step": "decoder_sparse_step",
}


DEFAULT_CENTROID_GAIN = 0.01
"""CPM-2's init_ckpt.py: orthogonal_(centroids, gain=0.01)."""
CENTROID_SEED = 1234


class UpcycleError(ValueError):
    """A dense model that cannot be upcycled as asked; the message names the flag or tensor."""


def upcycled_config(dense: T5Config, values: Mapping[str, Optional[object]]) -> T5Config:
    """The Mixture-of-Experts config of a dense one: `values` by T5Config field (None: the
    field's default; a router_topk alone means router_type 'topk', as the trainer's flags do;
    'cpm2' centroids' gain, router_centroid_gain, defaults to init_ckpt.py's 0.01, the norm
    `upcycle` draws them with).

    Raises:
        UpcycleError: a model with experts already, or values it cannot be built with.
    """
    if dense.is_moe:
        raise UpcycleError(f"the source has {dense.num_experts} experts already: --num-experts "
                           f"upcycles a dense model")
    changes = {k: v for k, v in values.items() if v is not None}
    if "router_topk" in changes and "router_type" not in changes:
        changes["router_type"] = "topk"
    if changes.get("router_type") == "cpm2":  # the config states the gain the centroids have
        changes.setdefault("router_centroid_gain", DEFAULT_CENTROID_GAIN)
    try:
        return dataclasses.replace(dense, **changes)
    except ConfigError as e:  # each problem named by the convert tool's flag for its field
        flags = {field: flag for flag, field in UPCYCLE_FLAGS.items()}
        named = [f"{flags.get(field, '--model-config')}: {message}"
                 for field, message in e.problems]
        raise UpcycleError("; ".join(named) or str(e)) from None


def _sparse_prefixes(config: T5Config) -> Dict[str, str]:
    """{our name of a sparse block's feed-forward sublayer: its stack}."""
    return {feed_forward_prefix(config, stack, i): stack
            for stack in ("encoder", "decoder")
            for i in config.sparse_blocks(stack == "decoder")}


def upcycle(tensors: Iterable[Tuple[str, torch.Tensor]], config: T5Config
            ) -> Iterator[Tuple[str, torch.Tensor]]:
    """The dense model's (name, full tensor) stream as the Mixture-of-Experts model `config`'s
    (module docstring; 'cpm2' centroids of norm config.router_centroid_gain, which
    `upcycled_config` sets): one stacked expert weight in memory at a time. Every name and
    shape is checked against `config`'s model as it passes.

    Raises:
        UpcycleError: a tensor the upcycled model does not have, a shape that does not fit, or
            tensors missing at the end.
    """
    expected = {**full_parameter_shapes(config), **buffer_shapes(config)}
    sparse = _sparse_prefixes(config)
    seen = set()

    def checked(name: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
        if name not in expected:
            raise UpcycleError(f"tensor {name} of the source is not a parameter of the "
                               f"upcycled model")
        if tuple(tensor.shape) != expected[name]:
            raise UpcycleError(f"tensor {name}: shape {tuple(tensor.shape)}, the upcycled "
                               f"model needs {expected[name]}")
        seen.add(name)
        return name, tensor

    routed = set()
    generator = torch.Generator().manual_seed(CENTROID_SEED)
    for name, tensor in tensors:
        prefix, dense, weight = name.partition(".DenseReluDense.")
        if not dense or prefix not in sparse:
            yield checked(name, tensor)
            continue
        copies = tensor.unsqueeze(0).expand(config.num_experts, *tensor.shape)
        yield checked(f"{prefix}.mlp.experts.{weight.removesuffix('.weight')}",
                      copies.contiguous())
        if prefix not in routed:
            routed.add(prefix)
            for name_, router in _router(prefix, config, tensor.dtype,
                                         config.router_centroid_gain, generator):
                yield checked(name_, router)
    missing = [n for n in expected if n not in seen]
    if missing:
        raise UpcycleError(f"{len(missing)} tensor(s) of the upcycled model not made from the "
                           f"source: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")


def _router(prefix: str, config: T5Config, dtype: torch.dtype, gain: float,
            generator: torch.Generator):
    """A sparse block's new router: zero (every expert equally likely), or CPM-2's centroids."""
    if config.router_type == "cpm2":
        centroids = torch.empty(config.num_experts, config.d_model)
        torch.nn.init.orthogonal_(centroids, gain=gain, generator=generator)
        yield f"{prefix}.mlp.router.expert_centroids", centroids.to(dtype)
        return
    yield f"{prefix}.mlp.router.classifier.weight", torch.zeros(config.num_experts,
                                                                config.d_model, dtype=dtype)
    if config.router_bias:
        yield f"{prefix}.mlp.router.classifier.bias", torch.zeros(config.num_experts,
                                                                  dtype=dtype)
    if config.moe_expert_bias:
        yield f"{prefix}.mlp.router.expert_bias", torch.zeros(config.num_experts,
                                                              dtype=torch.float32)
