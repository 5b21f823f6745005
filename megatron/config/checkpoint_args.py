"""The checkpoint flags of `megatron.pretrain_t5` (Megatron-LM's names): --save, --load and what
a load takes, asynchronous saves, --keep-last, the NaN and divergence guards that stop a run
before it saves; megatron/arguments.py collects them."""

from __future__ import annotations

import argparse

from megatron.config.checkpoint_storage import add_checkpoint_storage_args
from megatron.config.divergence_args import add_divergence_args


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """The 'checkpoints' group (with the divergence guard's flags), then the object-storage
    settings of checkpoints (checkpoint_storage.py)."""
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="checkpoint folder to write")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every this many steps (and always at the end)")
    g.add_argument("--load", default=None, help="checkpoint folder to resume from (a folder "
                   "with no checkpoint yet starts from scratch; not with --finetune or "
                   "--prompt-tune, which need its weights)")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="on --load, load iteration N (folder iter_0000020 for 20) instead of "
                        "the one the tracker names; the tracker is not changed until this run "
                        "saves (Megatron-LM's flag)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="on --load, do not restore optimizer states")
    g.add_argument("--no-load-rng", action="store_true",
                   help="on --load, do not restore random-number-generator states")
    g.add_argument("--finetune", action="store_true",
                   help="on --load, take only the weights: iteration, samples, optimizer, "
                        "RNG and LR schedule start fresh")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: a save blocks the step only "
                        "while the state is copied off the device")
    g.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep only the newest N checkpoints in --save (older ones are removed "
                        "once a newer one is committed; default: keep all)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="stop with exit 1, without saving, when a step's loss or gradient norm "
                        "is NaN or infinite (default on; fp16 overflow steps, which DeepSpeed "
                        "skips, excepted), after naming the first module whose output or "
                        "gradient was not finite (the step is run again with hooks; not with "
                        "a pipeline)")
    g.add_argument("--detect-nan-layers", action="store_true",
                   help="watch every module's output and gradient on every step (slower: one "
                        "isfinite reduction per module and parameter per micro-batch) and, "
                        "when the NaN guard stops the run, name the first non-finite one from "
                        "the failing step itself (not with a pipeline)")
    add_divergence_args(g)
    add_checkpoint_storage_args(parser)
