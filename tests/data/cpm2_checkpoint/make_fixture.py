"""Write tiny CPM-2 checkpoints and their logits with CPM-2-Pretrain's own code (run once; the
output is stored beside this script, see README.md). Not imported by any test.

    python tests/data/cpm2_checkpoint/make_fixture.py --cpm2-src /tmp/cpm2/src

For each model-parallel size (1 and 2) it starts that many CPU processes joined by gloo, builds
CPM-2's EncDecModel (src/model/enc_dec_modeling.py over src/mpu) from `config.json` with the
vocabulary `vocab.txt`, gives every parameter non-trivial values, wraps it in a DeepSpeed engine as
src/pretrain_enc_dec.py does and saves it with src/utils.py's save_checkpoint (DeepSpeed branch:
ITER/mp_rank_XX_model_states.pt, then the tracker). Then it runs the model on `inputs`, with the
masks their get_masks_and_position_ids builds (encoder: all ones; decoder: lower triangle; cross:
all ones), and saves the gathered logits.

Their code is run unchanged; only what needs CUDA or apex is replaced at run time, in this process:
- `apex.normalization.fused_layer_norm` (imported by src/mpu/layers.py, unused by the enc-dec
  model): a stub module. `torch._six` (src/mpu/grads.py takes `inf` from it; torch 2 removed
  it): a stub holding math.inf.
- `mpu.transformer_enc_dec.get_cuda_rng_tracker`: its fork() switches CUDA RNG states; with
  dropout 0 there is nothing to draw, so a tracker whose fork() does nothing.
- `torch.cuda.get_rng_state` (saved by save_checkpoint into 'cuda_rng_state'): the CPU state.
- their DistributedDataParallel wrapper is left out: it reads the removed `dist._backend`, and
  its state_dict() is its module's, so the saved names are the same.
- torch.optim.Adam instead of apex's FusedAdam (their --cpu-torch-adam choice); ZeRO stage 1 as in
  their configs/deepspeed/ds_cpm2.json, without fp16 (no fp16 on CPU). The ZeRO optimizer files
  and DeepSpeed's zero_to_*.py scripts are deleted afterwards: a conversion never opens them.
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
ITERATION = 7
MODEL_PARALLEL_SIZES = (1, 2)
BATCH, ENC_LEN, DEC_LEN = 2, 9, 6
SEED = 1234


def vocabulary():
    """64 entries: CPM-2's special tokens at their bpe_cn ids, some pieces, then sentinels."""
    special = ["<unk>", "<s>", "</s>", "\u2583", "<sep>", "<pad>", "<mask>", "<eod>", "\u2581"]
    pieces = list(",.的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你年")
    pieces += ["▁a", "▁the"] + list("abcdef")
    words = special + pieces
    words = words + [f"<s_{i}>" for i in range(64 - len(words))]
    assert len(words) == 64 and len(set(words)) == 64
    return words


def config():
    """CPM-2's own config format (src/configs/model/enc_dec_xlarge_config.json's keys), tiny.
    feed_forward_proj says 'relu' as theirs does: their code builds gated GELU whatever it says."""
    return {"d_model": 16, "d_ff": 24, "d_kv": 4, "num_heads": 4, "num_layers": 2,
            "num_decoder_layers": 2, "dropout_rate": 0.0, "feed_forward_proj": "relu",
            "init_method_std": 0.3, "initializer_factor": 1.0, "layer_norm_epsilon": 1e-06,
            "max_position_embeddings": 512, "use_cache": True,
            "use_scaled_init_for_output_weights": True, "do_dim_trick": False}


def inputs(vocab_size):
    g = torch.Generator().manual_seed(SEED)
    return {"enc_input_ids": torch.randint(0, vocab_size, (BATCH, ENC_LEN), generator=g),
            "dec_input_ids": torch.randint(0, vocab_size, (BATCH, DEC_LEN), generator=g)}


def _stub_cuda_only_parts(src: Path):
    sys.path.insert(0, str(src))
    for name in ("apex", "apex.normalization", "apex.normalization.fused_layer_norm"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["apex.normalization.fused_layer_norm"].FusedLayerNorm = torch.nn.LayerNorm
    sys.modules["torch._six"] = types.ModuleType("torch._six")  # gone from torch since 2.0
    sys.modules["torch._six"].inf = math.inf
    torch.cuda.get_rng_state = torch.get_rng_state
    import mpu  # their package, from src/

    class NoRngTracker:
        def fork(self, name="model-parallel-rng"):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

    mpu.transformer_enc_dec.get_cuda_rng_tracker = lambda: NoRngTracker()
    mpu.get_cuda_rng_tracker = lambda: NoRngTracker()
    return mpu


def _worker(rank, world_size, src, out, init_file):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    mpu = _stub_cuda_only_parts(Path(src))
    mpu.initialize_model_parallel(world_size)
    import deepspeed
    from learning_rates import AnnealingLR
    from model import EncDecConfig, EncDecModel
    from utils import save_checkpoint

    out = Path(out)
    cfg = EncDecConfig.from_json_file(str(out / "config.json"))
    cfg.vocab_size = len((out / "vocab.txt").read_text(encoding="utf-8").splitlines())
    torch.manual_seed(SEED)  # the same master weights on every rank, as their init assumes
    model = EncDecModel(cfg, parallel_output=False)
    # Non-trivial values everywhere: a rank's own part of the split tensors and of the bias
    # tables (heads split) drawn per rank; the replicated norms the same on every rank.
    own = torch.Generator().manual_seed(SEED + 1 + rank)
    same = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            split = getattr(p, "model_parallel", False) or "relative_attention_bias" in name
            g = own if split else same
            p.mul_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            if p.dim() == 1:
                p.add_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=g))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = AnnealingLR(optimizer, start_lr=1e-3, warmup_iter=10, num_iters=100,
                            decay_style="noam")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
                 "gradient_clipping": 1.0}
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, mpu=mpu,
        dist_init_required=False, config=ds_config)
    save = out / f"mp{world_size}"
    args = argparse.Namespace(deepspeed=True, save=str(save), no_save_rng=False,
                              no_save_optim=False)
    save_checkpoint(ITERATION, engine, optimizer, scheduler, args)

    data = inputs(cfg.vocab_size)
    enc, dec = data["enc_input_ids"], data["dec_input_ids"]
    masks = {"enc_attention_mask": torch.ones(BATCH, 1, ENC_LEN, ENC_LEN),
             "dec_attention_mask": torch.tril(torch.ones(BATCH, 1, DEC_LEN, DEC_LEN)),
             "cross_attention_mask": torch.ones(BATCH, 1, DEC_LEN, ENC_LEN)}
    model.eval()
    with torch.no_grad():
        logits = model(enc_input_ids=enc, dec_input_ids=dec, **masks)["lm_logits"]
    if rank == 0:
        torch.save({**data, "logits": logits.contiguous()}, save / "logits.pt")
        # Not read by a conversion: the ZeRO optimizer files (they would double the fixture)
        # and the recovery scripts DeepSpeed copies beside every save.
        for f in [*save.glob("*/zero_pp_rank_*_optim_states.pt"), *save.glob("zero_to_*.py")]:
            f.unlink()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpm2-src", required=True, help="CPM-2-Pretrain's src/ folder")
    p.add_argument("--out", default=str(HERE), help="where to write (default: beside this)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(), indent=2) + "\n")
    (out / "vocab.txt").write_text("\n".join(vocabulary()) + "\n", encoding="utf-8")
    for size in MODEL_PARALLEL_SIZES:
        shutil.rmtree(out / f"mp{size}", ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_worker, args=(size, args.cpm2_src, str(out),
                                              os.path.join(tmp, "rendezvous")),
                               nprocs=size, start_method="spawn")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
