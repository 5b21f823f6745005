"""Write reference outputs of CPM-2-MoE's BASE layer with CPM-2-Pretrain's own code (branch `moe`;
run once; the output is stored beside this script, see README.md). Not imported by any test.

    python tests/data/cpm2_moe/make_fixture.py --cpm2-src /tmp/cpm2moe/src

1. Builds their src/libbase/balanced_assignment.cpp with torch.utils.cpp_extension.load (in a
   temporary build folder) and registers it as sys.modules["libbase"], which is what their
   BaseLayer.load_assignment imports. `auction.pt`: libbase.balanced_assignment on fixed score
   matrices, each run in a child process with a timeout (none of them loops forever on torch
   2.13 CPU). Loop passes are counted without touching their code: the number of aten::topk calls
   the torch profiler sees (their loop calls topk_out once per pass; passes = counter + 1).
2. `base_layer_dpW.pt` (W = 2, 4) and `base_layer_dp2_mp2.pt`: their mpu.BaseLayer(config, ParallelFF,
   ...) on W CPU processes joined by gloo, forward and backward once, fp32, dropout 0.

Their code is run unchanged; only what needs CUDA or apex is replaced at run time, in the child
processes (as tests/data/cpm2_checkpoint/make_fixture.py does):
- `apex.normalization.fused_layer_norm` (imported by src/mpu/layers.py, unused here): a stub
  module. `torch._six` (src/mpu/grads.py takes `inf` from it; torch 2 removed it): a stub.
- `mpu.transformer_enc_dec.get_cuda_rng_tracker` / `mpu.get_cuda_rng_tracker`: a tracker whose
  fork() does nothing (dropout is 0, nothing is drawn).
- `torch.Tensor.cuda`: the identity (BaseLayer.forward calls `.cuda()` on its shuffle index).
The routing is recorded by wrapping the layer's bound `balanced_assignment` from the outside (an
instance attribute that calls theirs): its input scores and the returned sort_by_expert.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
SEED = 1234
BATCH, SEQ = 2, 8  # N = 16 tokens per rank
AUCTION_TIMEOUT_S = 120
LAYER_RUNS = (("base_layer_dp2.pt", 2, 1), ("base_layer_dp4.pt", 4, 1),
              ("base_layer_dp2_mp2.pt", 2, 2))  # (file, data-parallel size, model-parallel size)


def config():
    """CPM-2's config format (their EncDecConfig's keys), tiny; BaseLayer and ParallelFF read
    d_model, d_ff, dropout_rate and layer_norm_epsilon only."""
    return {"d_model": 16, "d_ff": 24, "d_kv": 4, "num_heads": 4, "num_layers": 1,
            "num_decoder_layers": 1, "dropout_rate": 0.0, "feed_forward_proj": "relu",
            "init_method_std": 0.3, "initializer_factor": 1.0, "layer_norm_epsilon": 1e-06,
            "use_scaled_init_for_output_weights": True, "do_dim_trick": False}


def auction_cases():
    """(name, scores [T, W] float32) with T tokens (jobs), W experts (workers), T % W == 0."""
    def randn(t, w, seed, scale=1.0):
        return torch.randn(t, w, generator=torch.Generator().manual_seed(seed)) * scale

    def same_preference(t, w, seed, noise):  # every expert prefers the same tokens
        g = torch.Generator().manual_seed(seed)
        column = torch.randn(t, 1, generator=g)
        return (column.expand(t, w) + noise * torch.randn(t, w, generator=g)).contiguous()

    cases = [("randn_16x2", randn(16, 2, 0)), ("randn_64x4", randn(64, 4, 1)),
             ("randn_96x8", randn(96, 8, 2))]
    cases += [(f"randn_512x32_seed{s}", randn(512, 32, s)) for s in (3, 4, 5)]
    cases += [("randn_1024x32", randn(1024, 32, 6)),  # 4096x32 would be 512 KiB alone
              ("tiny_range_1e-6_128x8", randn(128, 8, 7, 1e-6)),  # range/50 < their clamp 1e-4
              ("large_1e4_128x8", randn(128, 8, 8, 1e4)),
              ("rounded_1dp_128x8", randn(128, 8, 9).round(decimals=1)),  # many ties
              ("same_preference_64x8", same_preference(64, 8, 10, 1e-2)),
              ("same_preference_256x64", same_preference(256, 64, 1, 1e-3)),  # > 100 passes
              ("all_equal_16x2", torch.full((16, 2), 0.5)),
              ("all_equal_64x4", torch.zeros(64, 4))]
    return [(name, s.float().contiguous()) for name, s in cases]


def _load_libbase(build_dir):
    from torch.utils.cpp_extension import load
    torch.set_num_threads(1)
    src = Path(os.environ["CPM2_SRC"]) / "libbase" / "balanced_assignment.cpp"
    sys.modules["libbase"] = load(name="libbase", sources=[str(src)], build_directory=build_dir)
    return sys.modules["libbase"]


def _run_auction(scores):
    from torch.profiler import ProfilerActivity, profile
    libbase = sys.modules["libbase"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assignment = libbase.balanced_assignment(scores)
    return assignment, [e.name for e in prof.events()].count("aten::topk")


def write_auction(out: Path, build_dir):
    ctx = multiprocessing.get_context("spawn")
    records, skipped = [], []
    pool = ctx.Pool(1, initializer=_load_libbase, initargs=(build_dir,))
    for name, scores in auction_cases():
        try:
            assignment, passes = pool.apply_async(_run_auction, (scores,)).get(AUCTION_TIMEOUT_S)
        except multiprocessing.TimeoutError:
            skipped.append(name)
            pool.terminate()
            pool = ctx.Pool(1, initializer=_load_libbase, initargs=(build_dir,))
            continue
        is_perm = bool(torch.equal(assignment.sort().values, torch.arange(scores.size(0))))
        print(f"{name}: {passes} passes, permutation: {is_perm}")
        records.append({"name": name, "scores": scores, "assignment": assignment.contiguous(),
                        "passes": passes, "is_permutation": is_perm})
    pool.terminate()
    torch.save(records, out / "auction.pt")
    if skipped:
        print(f"skipped (ran past {AUCTION_TIMEOUT_S} s): {skipped}")


def _stub_cuda_only_parts(src: Path):
    sys.path.insert(0, str(src))
    for name in ("apex", "apex.normalization", "apex.normalization.fused_layer_norm"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["apex.normalization.fused_layer_norm"].FusedLayerNorm = torch.nn.LayerNorm
    sys.modules["torch._six"] = types.ModuleType("torch._six")  # gone from torch since 2.0
    sys.modules["torch._six"].inf = math.inf
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # BaseLayer: LongTensor(idxs).cuda()
    import mpu  # their package, from src/

    class NoRngTracker:
        def fork(self, name="model-parallel-rng"):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

    mpu.transformer_enc_dec.get_cuda_rng_tracker = lambda: NoRngTracker()
    mpu.get_cuda_rng_tracker = lambda: NoRngTracker()
    return mpu


def _plain(t):
    return None if t is None else t.detach().cpu().contiguous()


def _worker(rank, world_size, model_parallel_size, src, build_dir, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world_size)
    os.environ["CPM2_SRC"] = src
    _load_libbase(build_dir)
    mpu = _stub_cuda_only_parts(Path(src))
    mpu.initialize_model_parallel(model_parallel_size)
    from mpu.baselayer import BaseLayer
    from mpu.transformer_enc_dec import ParallelFF, scaled_init_method, unscaled_init_method
    from model.configuration_enc_dec import EncDecConfig

    cfg = EncDecConfig(**config())
    torch.manual_seed(SEED)
    layer = BaseLayer(cfg, ParallelFF, unscaled_init_method(cfg.init_method_std),
                      scaled_init_method(cfg.init_method_std, cfg.num_layers))
    dp, mp_rank = mpu.get_data_parallel_rank(), mpu.get_model_parallel_rank()
    # Routing state the same everywhere (orthogonal centroids with gain 1, so real score
    # differences decide); each expert's FFN its own: a full master weight drawn from the
    # data-parallel rank's seed, of which this model-parallel rank keeps its d_ff slice.
    same = torch.Generator().manual_seed(SEED)
    own = torch.Generator().manual_seed(SEED + 100 + dp)
    ff = layer.expert_network.dense_relu_dense
    part = slice(mp_rank * cfg.d_ff // model_parallel_size,
                 (mp_rank + 1) * cfg.d_ff // model_parallel_size)
    with torch.no_grad():
        torch.nn.init.orthogonal_(layer.expert_centroids, gain=1.0, generator=same)
        layer.expert_network.layer_norm.weight.uniform_(0.5, 1.5, generator=same)
        ff.wi_0.weight.copy_((0.5 * torch.randn(cfg.d_ff, cfg.d_model, generator=own))[part])
        ff.wi_1.weight.copy_((0.5 * torch.randn(cfg.d_ff, cfg.d_model, generator=own))[part])
        ff.wo.weight.copy_((0.3 * torch.randn(cfg.d_model, cfg.d_ff, generator=own))[:, part])
    # Inputs per data-parallel rank (the model-parallel ranks of one group see the same ones).
    x = torch.randn(BATCH, SEQ, cfg.d_model, generator=torch.Generator().manual_seed(SEED + 200 + dp))
    x.requires_grad_(True)
    grad_out = torch.randn(BATCH, SEQ, cfg.d_model,
                           generator=torch.Generator().manual_seed(SEED + 300 + dp))

    routing = {}
    theirs = layer.balanced_assignment

    def recording(scores):
        routing["scores"] = scores.detach().clone()
        result = theirs(scores)
        routing["sort_by_expert"] = result[0].detach().clone()
        return result

    layer.balanced_assignment = recording
    out = layer(x)
    out.backward(grad_out)
    assert layer.expert_centroids.grad is None  # scores are computed under no_grad
    torch.save({"rank": rank, "dp_rank": dp, "mp_rank": mp_rank, "x": _plain(x),
                "grad_out": grad_out, "out": _plain(out), "x_grad": _plain(x.grad),
                "params": {k: _plain(v) for k, v in layer.state_dict().items()},
                "grads": {k: _plain(p.grad) for k, p in layer.named_parameters()},
                "scores": _plain(routing["scores"]),
                "sort_by_expert": _plain(routing["sort_by_expert"])}, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def write_base_layers(out: Path, src, build_dir):
    for filename, dp_size, mp_size in LAYER_RUNS:
        world_size = dp_size * mp_size
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_worker, args=(world_size, mp_size, src, build_dir, tmp),
                               nprocs=world_size, start_method="spawn")
            ranks = [torch.load(f"{tmp}/rank{r}.pt", weights_only=True) for r in range(world_size)]
        torch.save({"config": config(), "world_size": world_size, "data_parallel_size": dp_size,
                    "model_parallel_size": mp_size, "ranks": ranks}, out / filename)
        print(f"wrote {filename}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpm2-src", required=True, help="CPM-2-Pretrain's src/ folder (branch moe)")
    p.add_argument("--out", default=str(HERE), help="where to write (default: beside this)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = str(Path(args.cpm2_src).resolve())
    os.environ["CPM2_SRC"] = src  # read by the spawned children too
    with tempfile.TemporaryDirectory() as build_dir:
        _load_libbase(build_dir)  # compile once, in this process; the children only load it
        write_auction(out, build_dir)
        write_base_layers(out, src, build_dir)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
