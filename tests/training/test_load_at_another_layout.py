"""`--load` at another layout (megatron/checkpoint/io/reshard.py): a checkpoint saved at one
TP x PP x DP x EP and ZeRO stage resumes directly in a run of another, and equals the offline
route (`convert_checkpoint.py --to megatron OUT` with the target sizes, then `--load OUT`) bit
for bit: the same losses and gradient norms at every step after the load, and the same
iteration. The log says which layouts.

- TP 2 (DP 1, ZeRO-0) -> TP 1 (DP 2, ZeRO-1): another TP and DP;
- PP 2 (DP 1, ZeRO-1) -> PP 1 (DP 2, ZeRO-3): another PP, DP and ZeRO stage;
- DP 2 ZeRO-3 -> DP 2 ZeRO-1 (the stage alone), with the weights alone (--no-load-optim);
- Mixture of Experts EP 2 (DP 2, ZeRO-1) -> EP 1 (DP 2, ZeRO-2).

(Before io/reshard.py each of these --load was refused: "saved with another layout".)"""

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain

from data_tools import convert_checkpoint

pytestmark = pytest.mark.slow

MOE = ("--num-experts", "4", "--moe-router-topk", "2")

SOURCES = {  # name: (flags, the layout's words in the log line)
    "tp2": (("--tensor-model-parallel-size", "2"), "TP 2 PP 1 DP 1 EP 1"),
    "pp2": (("--pipeline-model-parallel-size", "2", "--zero-stage", "1"), "TP 1 PP 2 DP 1 EP 1"),
    "z3": (("--zero-stage", "3"), "TP 1 PP 1 DP 2 EP 1"),
    "ep2": ((*MOE, "--expert-model-parallel-size", "2", "--zero-stage", "1"),
            "TP 1 PP 1 DP 2 EP 2"),
}
TARGETS = {  # source: (flags of the run that loads it, convert's target flags, log words)
    "tp2": (("--zero-stage", "1"), (), "TP 1 PP 1 DP 2 EP 1 (ZeRO 0 to 1)"),
    "pp2": (("--zero-stage", "3"), (), "TP 1 PP 1 DP 2 EP 1 (ZeRO 1 to 3)"),
    "z3": (("--zero-stage", "1", "--no-load-optim"), (), "TP 1 PP 1 DP 2 EP 1 (ZeRO 3 to 1)"),
    "ep2": ((*MOE, "--zero-stage", "2"), (), "TP 1 PP 1 DP 2 EP 1 (ZeRO 1 to 2)"),
}


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("load_at_another_layout")

    def argv(*extra):
        return base_argv(train_data, *extra, iters=4)

    run_workers(2, run_pretrain, [  # saved at iteration 2
        argv(*flags, "--save", str(root / name), "--exit-interval", "2")
        for name, (flags, _) in SOURCES.items()], timeout=900)
    loads = []
    for name, (flags, target, _) in TARGETS.items():
        offline = root / f"{name}_converted"
        rc = convert_checkpoint.main(["--load", str(root / name), "--to", "megatron",
                                      str(offline), "--no-progress", *target])
        assert rc == 0
        loads += [argv(*flags, "--load", str(root / name), "--log-file",
                       str(root / f"{name}.log")),
                  argv(*flags, "--load", str(offline))]
    results = run_workers(2, run_pretrain, loads, timeout=900)[0]
    return {name: (results[2 * i], results[2 * i + 1], root / f"{name}.log")
            for i, name in enumerate(TARGETS)}


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_direct_load_equals_the_offline_route_bit_for_bit(runs, name):
    direct, offline, log = runs[name]
    assert sorted(direct["losses"]) == [3, 4] and direct["iteration"] == 4
    assert direct["losses"] == offline["losses"]
    assert direct["grad_norms"] == offline["grad_norms"]
    assert [e[2] for e in direct["evals"]] == [e[2] for e in offline["evals"]]
    line = f"resharding the checkpoint from {SOURCES[name][1]} to {TARGETS[name][2]}"
    assert line in log.read_text()
