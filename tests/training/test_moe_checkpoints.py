"""Mixture-of-Experts checkpoints (4 experts, top-2; fp32): a run that stops and resumes under EP 2
equals the straight run, bit for bit; experts resharded with their optimizer states
(`convert_checkpoint.py --to megatron --target-expert-parallel-size N`) resume with the losses of
the run that wrote them, uninterrupted (rel 2e-5: another layout sums in another order):

- EP 2 (DP 2, ZeRO-1) -> EP 1 (DP 2, ZeRO-2) -> EP 2 (DP 4, ZeRO-2: two ranks per expert
  group) -> EP 1 (one process), and EP 2 -> EP 2 (a plain resume, rel 1e-6; also in bf16);
- EP 2 (ZeRO-0: DeepSpeed's per-expert-rank optimizer files) -> EP 4 (DP 4, ZeRO-1);
- EP 2 x TP 2 (ZeRO-2) -> EP 1 x TP 1 (one process);
- EP 2 with expert biases (a buffer, not in the optimizer) -> one process.

And an upcycled checkpoint (`--num-experts 4 --moe-router-topk 2` on a dense one) starts with the
dense model's first loss."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import run_workers
from train_workers import base_argv, run_pretrain

from data_tools import convert_checkpoint

pytestmark = pytest.mark.slow

MOE = ("--num-experts", "4", "--moe-router-topk", "2")
EP2 = ("--expert-model-parallel-size", "2")
BIAS = ("--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2")
RTOL = 2e-5
REPO = Path(__file__).resolve().parents[2]


def convert(source, out, *extra):
    rc = convert_checkpoint.main(["--load", str(source), "--to", "megatron", str(out),
                                  "--no-progress", *extra])
    assert rc == 0


def after(result, start, stop=None):
    """The losses of steps after `start` (up to `stop`), in order."""
    return [result["losses"][i] for i in sorted(result["losses"])
            if i > start and (stop is None or i <= stop)]


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")

    def argv(*extra, iters=6, model=None):
        return base_argv(train_data, *MOE, *extra, model=model, iters=iters)

    stop, dropout = str(root / "stop"), train_data.tiny_dropout
    two = run_workers(2, run_pretrain, [
        argv(*EP2, "--zero-stage", "1", model=dropout),
        argv(*EP2, "--zero-stage", "1", "--save", stop, "--exit-interval", "3", model=dropout),
        argv(*EP2, "--zero-stage", "1", "--save", stop, "--load", stop, model=dropout),
        argv(*EP2, "--zero-stage", "1", "--save", str(root / "z1"), "--save-interval", "2"),
        argv(*EP2, "--zero-stage", "0", "--save", str(root / "z0"), "--save-interval", "2",
             iters=4),
        argv(*EP2, *BIAS, "--zero-stage", "2", "--save", str(root / "bias"),
             "--save-interval", "2", iters=4),
        argv(*EP2, "--zero-stage", "1", "--bf16", "--save", str(root / "bf16"),
             "--save-interval", "2", iters=4),
    ], timeout=1200)[0]
    convert(root / "z1", root / "z1_as_ep1", "--iteration", "2")
    convert(root / "z1", root / "z1_as_ep2", "--iteration", "2",
            "--target-expert-parallel-size", "2")
    convert(root / "z0", root / "z0_as_ep4", "--iteration", "2",
            "--target-expert-parallel-size", "4")
    convert(root / "bf16", root / "bf16_again", "--iteration", "2",
            "--target-expert-parallel-size", "2")
    resumed = run_workers(2, run_pretrain, [
        argv("--zero-stage", "2", "--load", str(root / "z1_as_ep1"),
             "--save", str(root / "ep1"), "--exit-interval", "4"),
        argv(*EP2, "--zero-stage", "1", "--load", str(root / "z1_as_ep2")),
        argv(*EP2, "--zero-stage", "1", "--bf16", "--load", str(root / "bf16_again"), iters=4),
    ], timeout=1200)[0]
    convert(root / "ep1", root / "ep1_as_ep2", "--target-expert-parallel-size", "2")
    four = run_workers(4, run_pretrain, [
        argv("--expert-model-parallel-size", "4", "--zero-stage", "1", "--micro-batch-size", "1",
             "--load", str(root / "z0_as_ep4"), iters=4),
        argv(*EP2, "--zero-stage", "2", "--micro-batch-size", "1",
             "--load", str(root / "ep1_as_ep2"), "--save", str(root / "ep2_dp4"),
             "--exit-interval", "5"),
        argv(*EP2, "--tensor-model-parallel-size", "2", "--zero-stage", "2",
             "--save", str(root / "tp2"), "--save-interval", "2", iters=4),
    ], timeout=1800)[0]
    convert(root / "ep2_dp4", root / "ep2_dp4_as_ep1")
    convert(root / "tp2", root / "tp2_as_one", "--iteration", "2")
    convert(root / "bias", root / "bias_as_one", "--iteration", "2")
    one = run_workers(1, run_pretrain, [
        argv("--load", str(root / "ep2_dp4_as_ep1")),
        argv("--load", str(root / "tp2_as_one"), iters=4),
        argv(*BIAS, "--load", str(root / "bias_as_one"), iters=4),
    ], timeout=900)[0]
    return {"straight": two[0], "first": two[1], "second": two[2], "z1": two[3], "z0": two[4],
            "ep1": resumed[0], "ep2_again": resumed[1], "ep4": four[0], "ep2_dp4": four[1],
            "tp2": four[2], "last": one[0], "tp2_as_one": one[1], "bias": two[5],
            "bias_as_one": one[2], "bf16": two[6], "bf16_again": resumed[2], "root": root}


def test_resume_under_expert_parallelism_is_exact(runs):
    first, second, straight = runs["first"], runs["second"], runs["straight"]
    assert first["iteration"] == 3 and second["iteration"] == 6
    for i in range(1, 7):  # exact float equality: the same bits
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]


def test_experts_resharded_with_their_optimizer_states_continue_the_losses(runs):
    reference = runs["z1"]
    assert sorted(runs["ep1"]["losses"]) == [3, 4]
    assert after(runs["ep1"], 2) == pytest.approx(after(reference, 2, 4), rel=RTOL)
    assert sorted(runs["ep2_dp4"]["losses"]) == [5]
    assert after(runs["ep2_dp4"], 4) == pytest.approx(after(reference, 4, 5), rel=RTOL)
    assert sorted(runs["last"]["losses"]) == [6]
    assert after(runs["last"], 5) == pytest.approx(after(reference, 5), rel=RTOL)
    assert [e[2] for e in runs["last"]["evals"]] == pytest.approx(
        [e[2] for e in reference["evals"] if e[0] == 6], rel=RTOL)


def test_same_expert_layout_round_trip_is_a_plain_resume(runs):
    """fp32, and bf16 (its masters and moments fp32 in the converted files, its bf16 weights
    theirs rounded, as DeepSpeed makes them)."""
    assert after(runs["ep2_again"], 2) == pytest.approx(after(runs["z1"], 2), rel=1e-6)
    assert after(runs["bf16_again"], 2) == pytest.approx(after(runs["bf16"], 2), rel=1e-6)


def test_zero0_expert_files_to_four_expert_ranks(runs):
    reference = after(runs["z0"], 2)
    assert len(reference) == 2
    assert after(runs["ep4"], 2) == pytest.approx(reference, rel=RTOL)


def test_experts_with_tensor_parallelism_to_one_process(runs):
    assert after(runs["tp2_as_one"], 2) == pytest.approx(after(runs["tp2"], 2), rel=RTOL)


def test_expert_biases_are_carried(runs):
    """The routing biases (a buffer the optimizer does not hold, moved after every step) come
    with the weights: the one-process resume continues the EP 2 run."""
    from megatron.checkpoint.formats.deepspeed_files import load_file
    from megatron.checkpoint.formats.weights import WeightsReader

    module = load_file(runs["root"] / "bias" / "iter_0000002" / "mp_rank_00_model_states.pt")
    reader = WeightsReader(runs["root"] / "bias_as_one" / "iter_0000002")
    biases = [n for n in module["module"] if n.endswith("router.expert_bias")]
    assert len(biases) == 4 and any(module["module"][n].abs().sum() > 0 for n in biases)
    assert all(torch.equal(reader.slice(n), module["module"][n]) for n in biases)
    assert after(runs["bias_as_one"], 2) == pytest.approx(after(runs["bias"], 2), rel=RTOL)


def test_fp32_is_the_checkpoint_s_weights_bit_for_bit(runs, tmp_path):
    """--to fp32 of an EP 2 ZeRO-1 checkpoint: the fp32 masters, which in an fp32 run are the
    weights the model file (expert rank 0's experts) and the expert files hold."""
    import safetensors.torch

    from megatron.checkpoint.formats.deepspeed_files import load_file

    ckpt = runs["root"] / "z1"
    # the script by its path in this checkout, run from elsewhere: it finds its own package
    inspect = json.loads(subprocess.run(
        [sys.executable, str(REPO / "data_tools" / "convert_checkpoint.py"), "--inspect",
         str(ckpt)], capture_output=True, text=True, check=True, cwd=ckpt).stdout)
    assert inspect["problems"] == [] and inspect["optimizer_states_convertible"] is True
    assert inspect["experts"]["num_experts"] == 4
    assert inspect["experts"]["expert_model_parallel_size"] == 2
    assert "expert_parallel_rank_01_mp_rank_00_model_states.pt" in \
        {f["name"] for f in inspect["files"]}
    out = tmp_path / "fp32"
    assert convert_checkpoint.main(["--load", str(ckpt), "--to", "fp32", str(out),
                                    "--no-progress"]) == 0
    got = {}
    for f in sorted((out / "iter_0000006").glob("*.safetensors")):
        got.update(safetensors.torch.load_file(f))
    folder = ckpt / "iter_0000006"
    module = load_file(folder / "mp_rank_00_model_states.pt")["module"]
    ranks = [load_file(folder / f"expert_parallel_rank_{e:02d}_mp_rank_00_model_states.pt")
             for e in range(2)]
    assert got.keys() == module.keys()
    for name, tensor in module.items():
        want = torch.cat([r[name] for r in ranks]) if name in ranks[0] else tensor
        if name in ("shared.weight", "lm_head.weight"):
            want = want[:got[name].shape[0]]
        assert torch.equal(got[name], want), name


def test_upcycled_checkpoint_starts_with_the_dense_loss(train_data, tmp_path):
    """A dense run's checkpoint upcycled to 4 experts, top-2 (renormalised), zero routers: the
    trainer's first loss and its evaluations are the dense model's (megatron/checkpoint/formats/
    upcycle.py); both start from the same weights with --finetune on the same batch."""
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    run_workers(1, run_pretrain, [base_argv(train_data, "--save", str(dense), iters=1)],
                timeout=600)
    convert(dense, moe, "--num-experts", "4", "--moe-router-topk", "2")
    start = run_workers(1, run_pretrain, [
        base_argv(train_data, "--load", str(dense), "--finetune", iters=1),
        base_argv(train_data, *MOE, "--load", str(moe), "--finetune", iters=1),
    ], timeout=600)[0]
    assert start[1]["losses"][1] == pytest.approx(start[0]["losses"][1], rel=1e-6)
    assert [e[2] for e in start[1]["evals"]] == pytest.approx(
        [e[2] for e in start[0]["evals"]], rel=1e-6)
