"""Write tiny CPM-2-MoE checkpoints, and the losses of a few training steps after one, with the
`moe` branch of CPM-2-Pretrain (run once; the output is stored beside this script, see README.md).
Not imported by any test.

    python tests/data/cpm2_moe_checkpoint/make_fixture.py --cpm2-root /tmp/cpm2moe_ck

(/tmp/cpm2moe_ck: `git archive moe` of CPM-2-Pretrain, with src/libbase built in place:
`cd src/libbase && python setup.py build_ext --inplace`.)

1. Training saves, data-parallel size 2 x model-parallel size 1 and 2 (`dp2_mp1/`, `dp2_mp2/`):
   dp x mp CPU processes joined by gloo build their EncDecModel (every block's ff a BaseLayer over
   ParallelFF) from `config.json`, wrap it in their DistributedDataParallel (which broadcasts
   data rank 0's weights), give every parameter non-trivial values as a load would (each data
   rank's expert its own; the centroids as their BaseLayer drew them) and save with src/utils.py's
   save_checkpoint (non-DeepSpeed branch, as their scripts run: ITER/mp_rank_DD_MM_model_states.pt
   with {'iteration', 'model'}, then the tracker). Then STEPS training steps of their code from
   there: forward, their loss (vocab_parallel_cross_entropy, masked mean), backward, their
   allreduce_params(reduce_after=False), torch.optim.Adam (weight decay 0, constant lr), fp32;
   the batches and the losses go to `continuation.pt`.
2. init_ckpt.py's output (`init/`): their init_ckpt.py's text run with its hard-coded constants
   replaced for the tiny model (INIT_SUBSTITUTIONS) on the dense CPM-2 fixture
   tests/data/cpm2_checkpoint/mp2 (made by their main branch's code).

Their code is run unchanged; what needs CUDA, apex or an older torch is replaced at run time, in
these processes only (each named where it is done, and in README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
DENSE = HERE.parent / "cpm2_checkpoint"
ITERATION = 7
LAYOUTS = ((2, 1), (2, 2))  # (data-parallel size = experts, model-parallel size)
BATCH, ENC_LEN, DEC_LEN = 2, 9, 6
STEPS, LR, SEED = 3, 1e-3, 4321
GRADS = ("encoder.blocks.0.ff.expert_network.dense_relu_dense.wo.weight",
         "decoder.blocks.1.ff.expert_network.dense_relu_dense.wi_0.weight",
         "encoder.blocks.0.ff.expert_network.layer_norm.weight",
         "decoder.blocks.1.self_attn.self_attn.dense.weight")
"""Gradients kept after the first step's allreduce_params (model parallel 1): the scaling of an
expert's (not reduced) and a shared weight's (averaged), which Adam's losses barely show."""


def config():
    """The dense fixture's config (CPM-2's format, tiny: d_model 16, d_ff 24, 2 + 2 layers)."""
    return json.loads((DENSE / "config.json").read_text())


def batches(vocab_size, dp):
    """STEPS batches for each data rank: [STEPS, dp, BATCH, len] ids, labels and loss masks."""
    g = torch.Generator().manual_seed(SEED)
    enc = torch.randint(0, vocab_size, (STEPS, dp, BATCH, ENC_LEN), generator=g)
    dec = torch.randint(0, vocab_size, (STEPS, dp, BATCH, DEC_LEN + 1), generator=g)
    mask = torch.ones(STEPS, dp, BATCH, DEC_LEN)
    mask[:, :, 1, -2:] = 0  # padding at the end of the second target
    return {"enc_input_ids": enc, "dec_input_ids": dec[..., :-1].contiguous(),
            "labels": dec[..., 1:].contiguous(), "loss_mask": mask}


def _stub_cuda_only_parts(src: Path):
    sys.path[:0] = [str(src), str(src / "libbase")]  # libbase: their balanced assignment, built
    for name in ("apex", "apex.normalization", "apex.normalization.fused_layer_norm"):
        sys.modules[name] = types.ModuleType(name)  # imported by src/mpu/layers.py, unused
    sys.modules["apex.normalization.fused_layer_norm"].FusedLayerNorm = torch.nn.LayerNorm
    sys.modules["torch._six"] = types.ModuleType("torch._six")  # gone from torch since 2.0
    sys.modules["torch._six"].inf = math.inf
    torch.Tensor.cuda = lambda self, *a, **k: self  # BaseLayer's shuffle index: .cuda()
    torch.cuda.synchronize = lambda *a, **k: None  # allreduce_params waits for CUDA
    dist._backend = "gloo"  # read by their DistributedDataParallel; removed from torch
    dist.dist_backend = types.SimpleNamespace(GLOO="gloo", NCCL="nccl")
    import mpu  # their package, from src/

    class NoRngTracker:  # fork() switches CUDA RNG states; dropout is 0: nothing to draw
        def fork(self, name="model-parallel-rng"):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

    mpu.transformer_enc_dec.get_cuda_rng_tracker = lambda: NoRngTracker()
    mpu.get_cuda_rng_tracker = lambda: NoRngTracker()
    return mpu


def _worker(rank, dp, mp_size, src, out, init_file):
    world = dp * mp_size
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mpu = _stub_cuda_only_parts(Path(src))
    mpu.initialize_model_parallel(mp_size)
    from model import DistributedDataParallel, EncDecConfig, EncDecModel
    from utils import save_checkpoint

    out = Path(out)
    cfg = EncDecConfig.from_json_file(str(out / "config.json"))
    cfg.vocab_size = len((out / "vocab.txt").read_text(encoding="utf-8").splitlines())
    torch.manual_seed(SEED)  # the same draws on every rank: the centroids the same everywhere
    model = DistributedDataParallel(EncDecModel(cfg, parallel_output=True))
    d, m = mpu.get_data_parallel_rank(), mpu.get_model_parallel_rank()
    # Non-trivial values, as a load after the broadcast would give: each rank's part of the
    # split tensors drawn per model rank, each expert's per (data rank, model rank), the
    # replicated ones (the expert layer norm included: it is shared) the same everywhere.
    gens = {"own": torch.Generator().manual_seed(SEED + 1 + m),
            "expert": torch.Generator().manual_seed(SEED + 100 + 10 * d + m),
            "same": torch.Generator().manual_seed(SEED)}
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            if "expert_centroids" in name:
                continue  # their orthogonal draw, never trained
            expert = "expert_network" in name and "layer_norm" not in name
            split = getattr(p, "model_parallel", False) or "relative_attention_bias" in name
            g = gens["expert" if expert else "own" if split else "same"]
            p.mul_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            if p.dim() == 1:
                p.add_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=g))
    save = out / f"dp{dp}_mp{mp_size}"
    args = argparse.Namespace(deepspeed=False, save=str(save))
    save_checkpoint(ITERATION, model, None, None, args)

    # Training after the save, as their train_step without DeepSpeed, in fp32.
    for n, p in model.module.named_parameters():  # their get_optimizer's marking
        p.expert = "expert_network" in n and "layer_norm" not in n
    optimizer = torch.optim.Adam(model.module.parameters(), lr=LR, weight_decay=0.0)
    data = batches(cfg.vocab_size, dp)
    losses, rank_losses, grads = [], [], {}
    for step in range(STEPS):
        enc, dec = data["enc_input_ids"][step, d], data["dec_input_ids"][step, d]
        masks = {"enc_attention_mask": torch.ones(BATCH, 1, ENC_LEN, ENC_LEN),
                 "dec_attention_mask": torch.tril(torch.ones(BATCH, 1, DEC_LEN, DEC_LEN)),
                 "cross_attention_mask": torch.ones(BATCH, 1, DEC_LEN, ENC_LEN)}
        logits = model(enc_input_ids=enc, dec_input_ids=dec, **masks)["lm_logits"]
        token_losses = mpu.vocab_parallel_cross_entropy(logits.contiguous().float(),
                                                        data["labels"][step, d])
        mask = data["loss_mask"][step, d].view(-1)
        loss = torch.sum(token_losses.view(-1) * mask) / mask.sum()
        loss.backward()
        reduced = loss.detach().view(1).clone()
        dist.all_reduce(reduced)  # their backward_step's reported loss: the mean over ranks
        every = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(every, loss.detach().view(1))
        losses.append(reduced.item() / world)
        rank_losses.append([every[r * mp_size].item() for r in range(dp)])
        model.allreduce_params(reduce_after=False, fp32_allreduce=False)
        if step == 0 and mp_size == 1:
            params = dict(model.module.named_parameters())
            every = [None] * world
            dist.all_gather_object(every, {n: params[n].grad.clone() for n in GRADS})
            grads = {n: torch.stack([every[r][n] for r in range(dp)]) for n in GRADS}
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save({**data, "losses": torch.tensor(losses, dtype=torch.float64),
                    "rank_losses": torch.tensor(rank_losses, dtype=torch.float64),
                    "first_step_grads": grads,
                    "lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
                   save / "continuation.pt")
    dist.barrier()
    dist.destroy_process_group()


INIT_SUBSTITUTIONS = (
    # (their text, ours): the constants of init_ckpt.py for CPM-2 11B -> the tiny fixture
    ('"cpm-2/32000/mp_rank_0{}_model_states.pt".format(i) for i in range(4)',
     '"{dense}/7/mp_rank_0{}_model_states.pt".format(i) for i in range(2)'),
    ("'cpm-2/32000/mp_rank_00_model_states.pt'", "'{dense}/7/mp_rank_00_model_states.pt'"),
    ('output_dir = "expert-32/"', 'output_dir = "{out}/"'),
    ('"32000"', '"7"'),
    ("str(32000)", "str(7)"),
    ("range(24)", "range(2)"),
    ("torch.empty(32, 4096)", "torch.empty(2, 16)"),
)
"""The dense source (CPM-2 11B, model parallel 4 -> the dense fixture's model parallel 2, then
split to 4 by their unchanged ratio 2), the output folder and iteration, 24 -> 2 layers, 32
experts x d_model 4096 -> 2 x 16. Nothing else in the text changes."""


def make_init(root: Path, out: Path):
    text = (root / "init_ckpt.py").read_text()
    for theirs, ours in INIT_SUBSTITUTIONS:
        ours = ours.replace("{dense}", str(DENSE / "mp2")).replace("{out}", str(out))
        assert theirs in text, theirs
        text = text.replace(theirs, ours)
    sys.modules.setdefault("tqdm", types.SimpleNamespace(tqdm=lambda x: x))
    load = torch.load
    # their torch.load predates weights_only; the dense fixture holds numpy RNG states
    torch.load = lambda *a, **k: load(*a, **{"weights_only": False, **k})
    torch.manual_seed(SEED)  # their orthogonal_ centroids
    try:
        exec(compile(text, str(root / "init_ckpt.py"), "exec"), {"__name__": "__main__"})
    finally:
        torch.load = load


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpm2-root", required=True, help="CPM-2-Pretrain's moe branch, unpacked, "
                   "src/libbase built")
    p.add_argument("--out", default=str(HERE), help="where to write (default: beside this)")
    args = p.parse_args(argv)
    root, out = Path(args.cpm2_root), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DENSE / "config.json", out / "config.json")
    shutil.copyfile(DENSE / "vocab.txt", out / "vocab.txt")
    for dp, mp_size in LAYOUTS:
        shutil.rmtree(out / f"dp{dp}_mp{mp_size}", ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_worker, args=(dp, mp_size, str(root / "src"), str(out),
                                              os.path.join(tmp, "rendezvous")),
                               nprocs=dp * mp_size, start_method="spawn")
    shutil.rmtree(out / "init", ignore_errors=True)
    make_init(root, out / "init")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
