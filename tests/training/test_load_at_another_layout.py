"""`--load` at another layout (megatron/checkpoint/io/reshard.py): a checkpoint saved at one
TP x PP x DP x EP and ZeRO stage resumes directly in a run of another, and equals the offline
route (`convert_checkpoint.py --to megatron OUT`, then `--load OUT`) bit for bit: the same
losses and gradient norms at every step after the load, and the same evaluations and iteration.
The log says which layouts.

- TP 2 (DP 1, ZeRO-0) -> TP 1 (DP 2, ZeRO-1): another TP and DP;
- TP 2 (ZeRO-0) -> PP 2 split at the decoder (ZeRO-1);
- PP 2 (DP 1, ZeRO-1) -> PP 1 (DP 2, ZeRO-3): another PP, DP and ZeRO stage;
- DP 2 ZeRO-3 -> DP 2 ZeRO-1 (the stage alone), and so with the weights alone (--no-load-optim);
- Mixture of Experts EP 2 (DP 2, ZeRO-1) -> EP 1 (DP 2, ZeRO-2).

And in-process, every rank's slice at TP 1, 2 and 4 (EP 1, 2, 4 of the experts) of the weights,
masters and moments read from the saved files equals the one read from the converted folder
(at TP 2 and 4 a rank reads only the saved shards its slice overlaps).

(Before io/reshard.py each of these --load was refused: "saved with another layout".)"""

import pytest
import torch

from harness import run_workers
from train_workers import base_argv, run_pretrain

from data_tools import convert_checkpoint

pytestmark = pytest.mark.slow

MOE = ("--num-experts", "4", "--moe-router-topk", "2")

SOURCES = {  # name: (flags, the layout's words in the log line); saved at iteration 2
    "tp2": (("--tensor-model-parallel-size", "2"), "TP 2 PP 1 DP 1 EP 1"),
    "pp2": (("--pipeline-model-parallel-size", "2", "--zero-stage", "1"), "TP 1 PP 2 DP 1 EP 1"),
    "z3": (("--zero-stage", "3"), "TP 1 PP 1 DP 2 EP 1"),
    "ep2": ((*MOE, "--expert-model-parallel-size", "2", "--zero-stage", "1"),
            "TP 1 PP 1 DP 2 EP 2"),
}
CASES = {  # case: (source, flags of the run that loads it, log words of its layout)
    "tp2_to_tp1": ("tp2", ("--zero-stage", "1"), "TP 1 PP 1 DP 2 EP 1 (ZeRO 0 to 1)"),
    "pp2_to_pp1": ("pp2", ("--zero-stage", "3"), "TP 1 PP 1 DP 2 EP 1 (ZeRO 1 to 3)"),
    "tp2_to_pp2": ("tp2", ("--pipeline-model-parallel-size", "2",
                           "--pipeline-model-parallel-split-rank", "1", "--zero-stage", "1"),
                   "TP 1 PP 2 DP 1 EP 1 (ZeRO 0 to 1)"),
    "z3_to_z1": ("z3", ("--zero-stage", "1"), "TP 1 PP 1 DP 2 EP 1 (ZeRO 3 to 1)"),
    "z3_to_z1_weights": ("z3", ("--zero-stage", "1", "--no-load-optim"),
                         "TP 1 PP 1 DP 2 EP 1 (ZeRO 3 to 1)"),
    "ep2_to_ep1": ("ep2", (*MOE, "--zero-stage", "2"), "TP 1 PP 1 DP 2 EP 1 (ZeRO 1 to 2)"),
}


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("load_at_another_layout")

    def argv(*extra):
        return base_argv(train_data, *extra, iters=4)

    run_workers(2, run_pretrain, [
        argv(*flags, "--save", str(root / name), "--exit-interval", "2")
        for name, (flags, _) in SOURCES.items()], timeout=900)
    for name in SOURCES:
        rc = convert_checkpoint.main(["--load", str(root / name), "--to", "megatron",
                                      str(root / f"{name}_converted"), "--no-progress"])
        assert rc == 0
    loads = []
    for case, (source, flags, _) in CASES.items():
        loads += [argv(*flags, "--load", str(root / source), "--log-file",
                       str(root / f"{case}.log")),
                  argv(*flags, "--load", str(root / f"{source}_converted"))]
    results = run_workers(2, run_pretrain, loads, timeout=900)[0]
    return {"root": root, **{case: (results[2 * i], results[2 * i + 1], root / f"{case}.log")
                             for i, case in enumerate(CASES)}}


@pytest.mark.parametrize("case", list(CASES))
def test_a_direct_load_equals_the_offline_route_bit_for_bit(runs, case):
    direct, offline, log = runs[case]
    assert sorted(direct["losses"]) == [3, 4] and direct["iteration"] == 4
    assert direct["losses"] == offline["losses"]
    assert direct["grad_norms"] == offline["grad_norms"]
    assert [e[2] for e in direct["evals"]] == [e[2] for e in offline["evals"]]
    source = CASES[case][0]
    line = f"resharding the checkpoint from {SOURCES[source][1]} to {CASES[case][2]}"
    assert line in log.read_text()


@pytest.mark.parametrize("source", ["tp2", "ep2"])
def test_every_rank_s_slice_equals_the_converted_folder_s(runs, source):
    from megatron.checkpoint.formats.meta import model_config, read_meta
    from megatron.checkpoint.formats.weights import MOMENTS, WeightsReader, local_tensor
    from megatron.checkpoint.io.reshard import ShardedCheckpointReader
    from megatron.model.meta import meta_model

    saved = next((runs["root"] / source).glob("iter_*"))
    converted = next((runs["root"] / f"{source}_converted").glob("iter_*"))
    meta = read_meta(saved)
    config = model_config(meta)
    for prefix in ("model", *MOMENTS):
        ours, theirs = ShardedCheckpointReader(saved, prefix), WeightsReader(converted, prefix)
        assert ours.names() == theirs.names()
        for tp, ep in ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4)) if config.num_experts else \
                ((1, 1), (2, 1), (4, 1)):
            for rank in range(max(tp, ep)):
                t, e = rank % tp, rank % ep
                model = meta_model(config, 128, tp, t, ep, e)
                for name, param in model.named_parameters():  # (meta: shapes alone)
                    got = local_tensor(param, name, ours, config.vocab_size, t, tp, e, ep)
                    want = local_tensor(param, name, theirs, config.vocab_size, t, tp, e, ep)
                    assert torch.equal(got, want), (prefix, tp, ep, rank, name)
