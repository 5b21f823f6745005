"""Worker body of the CPM-2 BaseLayer comparison (importable by spawned processes)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.model import T5Config
from megatron.model.transformer import InitMethods, T5LayerFF
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "cpm2_moe"
THEIRS = "expert_network.dense_relu_dense."


def our_layer(fixture: dict, tp: int, ep: int) -> T5LayerFF:
    """Our feed-forward sublayer with router 'cpm2' at TP `tp`, EP `ep`, holding the weights
    CPM-2's BaseLayer had on this process (its data-parallel rank's expert, its d_ff slice)."""
    cpm2 = fixture["config"]
    config = T5Config(vocab_size=8, d_model=cpm2["d_model"], d_kv=cpm2["d_kv"],
                      d_ff=cpm2["d_ff"], num_heads=cpm2["num_heads"], num_layers=1,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0,
                      layer_norm_epsilon=cpm2["layer_norm_epsilon"], num_experts=ep,
                      router_type="cpm2")
    layer = T5LayerFF(config, InitMethods(config, 1), tp=TensorParallel.of_this_process(),
                      ep=ExpertParallel.of_this_process(), sparse_layers=1)
    theirs = fixture["ranks"][dist.get_rank()]["params"]
    with torch.no_grad():
        layer.layer_norm.weight.copy_(theirs["expert_network.layer_norm.weight"])
        layer.mlp.router.expert_centroids.copy_(theirs["expert_centroids"])
        for name in ("wi_0", "wi_1", "wo"):
            getattr(layer.mlp.experts, name)[0].copy_(theirs[THEIRS + name + ".weight"])
    return layer


def base_layer_step(rank, world_size, name):
    """Our layer's output, input gradient and gradients (the layer norm's summed over the
    data-parallel ranks) on this process's inputs of fixture `name`."""
    fixture = torch.load(FIXTURES / name, weights_only=True)
    tp = fixture["model_parallel_size"]
    ep = fixture["data_parallel_size"]
    parallel_state.initialize_model_parallel(tp, 1, ep)
    layer = our_layer(fixture, tp, ep)
    mine = fixture["ranks"][rank]
    x = mine["x"].clone().requires_grad_(True)
    out, aux = layer(x)
    out.backward(mine["grad_out"])
    norm = layer.layer_norm.weight.grad.clone()
    dist.all_reduce(norm, group=parallel_state.get_data_parallel_group())
    experts = layer.mlp.experts
    return {"out": out.detach(), "aux": aux, "x_grad": x.grad,
            "layer_norm_sum": norm,
            "grads": {n: getattr(experts, n).grad[0].clone() for n in ("wi_0", "wi_1", "wo")},
            "centroids_grad": layer.mlp.router.expert_centroids.grad}
