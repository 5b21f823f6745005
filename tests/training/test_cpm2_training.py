"""Training with the 'cpm2' router (CPM-2-MoE's BASE layers, 2 experts; fp32): the experts split
over 2 data-parallel ranks (EP = DP = 2, ZeRO-1) give the losses and gradient norms of one
process holding both experts with the same global batch in one micro-batch (CPM-2 routes over
the whole data-parallel group, so one process stands for both ranks by cutting its micro-batch
in two), also with a pipeline of two stages; every expert gets exactly its equal share in every logged step (max load 1.00,
nothing dropped); the frozen centroids are saved and stay bit for bit what they were; a run
that stops and resumes equals the straight run."""

import pytest
import torch

from harness import run_workers
from train_workers import assert_same_run, base_argv, run_pretrain

pytestmark = pytest.mark.slow

CPM2 = ("--num-experts", "2", "--moe-router-type", "cpm2")
EP2 = ("--expert-model-parallel-size", "2", "--zero-stage", "1")


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("cpm2")
    saved, stop = root / "saved", root / "stop"
    one = run_workers(1, run_pretrain, [base_argv(train_data, *CPM2, "--micro-batch-size", "4")],
                      timeout=600)[0][0]
    two = run_workers(2, run_pretrain, [
        base_argv(train_data, *CPM2, *EP2, "--save", str(saved), "--save-interval", "2"),
        base_argv(train_data, *CPM2, *EP2, "--save", str(stop), "--exit-interval", "2"),
        base_argv(train_data, *CPM2, *EP2, "--save", str(stop), "--load", str(stop)),
    ], timeout=900)[0]
    return {"one": one, "two": two[0], "resumed": two[2], "saved": saved}


def test_two_ranks_with_one_expert_each_equal_one_process(runs):
    assert_same_run(runs["two"], runs["one"], rtol=2e-5, label="EP = DP = 2")


def test_every_expert_gets_its_equal_share_in_every_step(runs):
    for run in (runs["one"], runs["two"]):
        assert sorted(run["moe"]) == [2, 4]
        for layers in run["moe"].values():
            assert len(layers) == 4  # tiny.json: 2 + 2 blocks, all sparse
            for values in layers.values():
                assert values["max_load"] == 1.0
                assert values["dropped"] == 0.0


def test_the_centroids_are_saved_and_never_change(runs):
    from megatron.checkpoint.formats.deepspeed_files import load_file

    def module(iteration):
        path = runs["saved"] / f"iter_{iteration:07d}" / "mp_rank_00_model_states.pt"
        return load_file(path)["module"]

    early, late = module(2), module(4)
    names = [n for n in early if n.endswith("mlp.router.expert_centroids")]
    assert len(names) == 4
    for name in names:
        assert torch.equal(early[name], late[name]), name
        centroids = early[name].double()  # orthogonal rows of norm 0.1 (CPM-2's BaseLayer)
        torch.testing.assert_close(centroids @ centroids.T, 0.01 * torch.eye(2, dtype=torch.float64))
    experts = [n for n in early if n.endswith("mlp.experts.wi_0")]
    assert experts and all(not torch.equal(early[n], late[n]) for n in experts)


def test_a_resumed_run_is_the_straight_run(runs):
    resumed, straight = runs["resumed"]["losses"], runs["two"]["losses"]
    assert sorted(resumed) == [3, 4]
    assert [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)]


def test_a_pipeline_of_two_stages_with_the_experts_split_equals_one_process(train_data, runs):
    """PP 2 x DP 2, EP = DP = 2: each stage routes its own blocks over its data-parallel pair."""
    got = run_workers(4, run_pretrain, [
        base_argv(train_data, *CPM2, *EP2, "--pipeline-model-parallel-size", "2")],
        timeout=900)
    result = next(r[0] for r in got if r[0]["losses"])
    assert_same_run(result, runs["one"], rtol=2e-5, label="PP 2 x EP = DP = 2")
