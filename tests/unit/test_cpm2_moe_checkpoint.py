"""CPM-2-MoE checkpoints through `convert_checkpoint.py --from cpm2` / `--to cpm2`
(megatron/checkpoint/formats/cpm2_moe.py), on checkpoints written by CPM-2's moe branch
(tests/data/cpm2_moe_checkpoint, see its README): training saves at data parallel 2 x model
parallel 1 and 2, and init_ckpt.py's upcycling of the dense CPM-2 fixture (model parallel 4).

Read: each expert from its data rank's files, the model-parallel shards merged, the centroids and
the shared layer norm from data rank 0. Written back: the same files, names, order, dtypes and
values, and the same tracker. Upcycling with --moe-router-type cpm2 is init_ckpt.py up to its
random centroids. Bad inputs exit non-zero with one message and leave nothing behind."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from data_tools import convert_checkpoint
from megatron.checkpoint.formats import cpm2, cpm2_moe
from megatron.checkpoint.formats.deepspeed import find_iteration, iter_full_tensors
from megatron.model.config import T5Config

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "cpm2_moe_checkpoint"
DENSE = REPO / "tests" / "data" / "cpm2_checkpoint"
CONFIG = FIXTURE / "config.json"
SAVES = ("dp2_mp1", "dp2_mp2")
EXPERTS = 2


def convert(*argv):
    return convert_checkpoint.main([*map(str, argv), "--no-progress"])


def their_files(folder):
    """{file name: their 'model' state dict} of a training save's iteration folder."""
    return {p.name: torch.load(p, map_location="cpu", weights_only=True)["model"]
            for p in sorted(folder.glob("*_model_states.pt"))}


def read(layout):
    config, tensors, source, notes = cpm2.read_cpm2_checkpoint(FIXTURE / layout, CONFIG,
                                                               vocab=FIXTURE / "vocab.txt")
    return config, dict(tensors), source, notes


def merged(shards, name):
    """A feed-forward weight of one data rank, its model-parallel shards joined."""
    return torch.cat([s[name] for s in shards], 1 if ".wo." in name else 0)


# Reading ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", SAVES)
def test_a_training_save_reads_expert_e_from_data_rank_e(layout):
    config, full, source, notes = read(layout)
    assert (config.num_experts, config.router_type) == (EXPERTS, "cpm2")
    assert config.sparse_blocks(False) == [0, 1] and config.sparse_blocks(True) == [0, 1]
    mp = int(layout[-1])
    assert source["cpm2_layout"] == "save" and source["model_parallel_size"] == mp
    files = their_files(FIXTURE / layout / "7")
    ranks = [[files[f"mp_rank_{d:02d}_{m:02d}_model_states.pt"] for m in range(mp)]
             for d in range(EXPERTS)]
    for stack, j in (("encoder", 1), ("decoder", 2)):
        for i in range(2):
            ours, theirs = f"{stack}.block.{i}.layer.{j}", f"{stack}.blocks.{i}.ff"
            for w in ("wi_0", "wi_1", "wo"):
                name = f"{theirs}.expert_network.dense_relu_dense.{w}.weight"
                want = torch.stack([merged(ranks[d], name) for d in range(EXPERTS)])
                assert torch.equal(full[f"{ours}.mlp.experts.{w}"], want)
            assert not torch.equal(full[f"{ours}.mlp.experts.wi_0"][0],
                                   full[f"{ours}.mlp.experts.wi_0"][1])
            assert torch.equal(full[f"{ours}.mlp.router.expert_centroids"],
                               ranks[0][0][f"{theirs}.expert_centroids"])
            assert torch.equal(full[f"{ours}.layer_norm.weight"],
                               ranks[0][0][f"{theirs}.expert_network.layer_norm.weight"])
    assert torch.equal(full["shared.weight"], torch.cat([r["word_embeds.weight"]
                                                         for r in ranks[0]]))
    assert not [n for n in notes if "differ" in n]  # their shared tensors agree over data ranks


def test_init_ckpt_output_gives_every_expert_the_dense_feed_forward():
    config, full, source, notes = read("init")
    assert source["cpm2_layout"] == "init" and source["model_parallel_size"] == 4
    assert any("init_ckpt.py" in n for n in notes)
    _, dense, _, _ = cpm2.read_cpm2_checkpoint(DENSE / "mp2", DENSE / "config.json")
    dense = dict(dense)
    for stack, j in (("encoder", 1), ("decoder", 2)):
        for i in range(2):
            ours = f"{stack}.block.{i}.layer.{j}"
            for w in ("wi_0", "wi_1", "wo"):
                got = full[f"{ours}.mlp.experts.{w}"]
                assert got.dtype == torch.float16  # init_ckpt.py halves everything
                want = dense[f"{ours}.DenseReluDense.{w}.weight"].half()
                assert all(torch.equal(got[e], want) for e in range(EXPERTS))
            c = full[f"{ours}.mlp.router.expert_centroids"].float()
            torch.testing.assert_close(c @ c.T, 0.01 ** 2 * torch.eye(EXPERTS),
                                       rtol=0, atol=2e-7)  # orthogonal_(gain=0.01), in fp16
    assert torch.equal(full["lm_head.weight"], dense["lm_head.weight"].half())


def test_shared_tensors_that_differ_over_data_ranks_are_noted(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "dp2_mp1", ckpt)
    path = ckpt / "7" / "mp_rank_01_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    name = "decoder.blocks.1.ff.expert_network.layer_norm.weight"
    state["model"][name] = state["model"][name] + 0.25
    torch.save(state, path)
    _, tensors, _, notes = cpm2.read_cpm2_checkpoint(ckpt, CONFIG)
    full = dict(tensors)
    note, = [n for n in notes if "differ" in n]
    assert "0.25" in note and name in note and "data rank 1" in note
    first = torch.load(ckpt / "7" / "mp_rank_00_00_model_states.pt", weights_only=True)
    assert torch.equal(full["decoder.block.1.layer.2.layer_norm.weight"], first["model"][name])


# Writing back: bit-exact -----------------------------------------------------------------------
def assert_same_checkpoint(got, want):
    assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(want).as_posix() for p in want.rglob("*_model_states.pt")) + \
        ["latest_checkpointed_iteration.txt"]
    tracker = "latest_checkpointed_iteration.txt"
    assert (got / tracker).read_bytes() == (want / tracker).read_bytes()
    for path in sorted((want / "7").glob("*.pt")):
        theirs = cpm2_moe._model(path)
        ours = torch.load(got / "7" / path.name, weights_only=True)
        assert ours["iteration"] == 7
        assert list(ours["model"]) == list(theirs)  # names, in their order
        for name, t in theirs.items():
            mine = ours["model"][name]
            assert mine.dtype == t.dtype and mine.shape == t.shape, name
            assert torch.equal(mine, t), name


@pytest.mark.parametrize("layout", (*SAVES, "init"))
def test_from_cpm2_to_cpm2_is_bit_exact(layout, tmp_path):
    out = tmp_path / "out"
    assert convert("--from", "cpm2", FIXTURE / layout, "--model-config", CONFIG,
                   "--to", "cpm2", out) == 0
    assert_same_checkpoint(out, FIXTURE / layout)


@pytest.mark.parametrize("layout,ep,tp", [("dp2_mp1", 2, 1), ("dp2_mp2", 2, 2),
                                          ("dp2_mp2", 1, 1)])
def test_through_ours_at_any_ep_and_tp_is_bit_exact(layout, ep, tp, tmp_path):
    ours = tmp_path / "ours"
    assert convert("--from", "cpm2", FIXTURE / layout, "--model-config", CONFIG, "--to",
                   "megatron", ours, "--target-expert-parallel-size", ep,
                   "--target-tensor-parallel-size", tp) == 0
    meta = json.loads(next(ours.glob("iter_*/meta.json")).read_text())
    assert meta["model"]["config"]["router_type"] == "cpm2"
    back = tmp_path / "back"
    assert convert("--load", ours, "--to", "cpm2", back, "--target-tensor-parallel-size",
                   layout[-1]) == 0
    assert_same_checkpoint(back, FIXTURE / layout)


def test_a_model_parallel_size_of_choice_and_fp16(tmp_path):
    out = tmp_path / "out"
    assert convert("--from", "cpm2", FIXTURE / "dp2_mp1", "--model-config", CONFIG, "--to",
                   "cpm2", out, "--target-tensor-parallel-size", 4, "--dtype", "fp16") == 0
    names = sorted(p.name for p in (out / "7").iterdir())
    assert names == [f"mp_rank_{d:02d}_{m:02d}_model_states.pt" for d in range(2)
                     for m in range(4)]
    _, full, _, _ = read("dp2_mp1")
    _, again, _, _ = cpm2.read_cpm2_checkpoint(out, CONFIG)
    again = dict(again)
    assert list(again) == list(full)
    for name, t in full.items():
        assert again[name].dtype == torch.float16 and torch.equal(again[name], t.half()), name


# Upcycling -------------------------------------------------------------------------------------
def test_upcycling_dense_cpm2_is_init_ckpt(tmp_path):
    """--num-experts 2 --moe-router-type cpm2 --to cpm2 at model parallel 4 in fp16: init_ckpt.py's
    output on the same dense checkpoint, tensor for tensor, except the (random) centroids, which
    are orthogonal with norm G."""
    out, gain = tmp_path / "out", 0.05
    assert convert("--from", "cpm2", DENSE / "mp2", "--model-config", DENSE / "config.json",
                   "--num-experts", EXPERTS, "--moe-router-type", "cpm2", "--moe-centroid-gain",
                   gain, "--to", "cpm2", out, "--target-tensor-parallel-size", 4,
                   "--dtype", "fp16") == 0
    want = FIXTURE / "init"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == \
        (want / "latest_checkpointed_iteration.txt").read_text()
    for path in sorted((want / "7").glob("*.pt")):
        theirs = cpm2_moe._model(path)
        ours = torch.load(out / "7" / path.name, weights_only=True)["model"]
        assert list(ours) == list(theirs)
        for name, t in theirs.items():
            assert ours[name].dtype == t.dtype
            if name.endswith("expert_centroids"):
                c = ours[name].float()
                torch.testing.assert_close(c @ c.T, gain ** 2 * torch.eye(EXPERTS), rtol=0,
                                           atol=2e-3 * gain ** 2)
            else:
                assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("given", [None, 0.3])
def test_upcycling_ours_gives_dense_experts_and_centroids_of_the_gain(tmp_path, given):
    """The experts are the dense feed-forward; the centroids orthogonal with the row norm
    --moe-centroid-gain gives (default init_ckpt.py's 0.01), which model_config.json states,
    with no router_topk (a CPM-2 router sends each token to one expert)."""
    dense = tmp_path / "dense"
    assert convert("--from", "cpm2", DENSE / "mp1", "--model-config", DENSE / "config.json",
                   "--to", "megatron", dense) == 0
    moe, gain = tmp_path / "moe", 0.01 if given is None else given
    assert convert("--load", dense, "--num-experts", EXPERTS, "--moe-router-type", "cpm2",
                   *(() if given is None else ("--moe-centroid-gain", given)), "--to",
                   "megatron", moe, "--target-expert-parallel-size", 2) == 0
    before = dict(iter_full_tensors(find_iteration(dense)))
    after = dict(iter_full_tensors(find_iteration(moe)))
    centroids = [n for n in after if n.endswith("mlp.router.expert_centroids")]
    assert len(centroids) == 4
    for name in centroids:
        c = after[name].double()
        torch.testing.assert_close(c @ c.T, gain ** 2 * torch.eye(EXPERTS, dtype=torch.float64),
                                   rtol=0, atol=1e-6)
        prefix = name.removesuffix(".mlp.router.expert_centroids")
        for w in ("wi_0", "wi_1", "wo"):
            experts = after[f"{prefix}.mlp.experts.{w}"]
            assert all(torch.equal(experts[e], before[f"{prefix}.DenseReluDense.{w}.weight"])
                       for e in range(EXPERTS))
    written = json.loads((moe / "model_config.json").read_text())
    assert (written["router_type"], written["router_centroid_gain"]) == ("cpm2", gain)
    assert "router_topk" not in written and T5Config.from_dict(written).router_k == 1


# Bad inputs ------------------------------------------------------------------------------------
def refused(capsys, tmp_path, *argv, code=1, to="megatron"):
    out = tmp_path / "out"
    assert convert(*argv, "--to", to, out) == code
    assert not out.exists() and not out.with_name("out.tmp").exists()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1, err
    return err


def test_a_missing_data_rank_file_is_named(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "dp2_mp2", ckpt)
    (ckpt / "7" / "mp_rank_00_01_model_states.pt").unlink()
    err = refused(capsys, tmp_path, "--from", "cpm2", ckpt, "--model-config", CONFIG)
    assert "mp_rank_00_01_model_states.pt: missing" in err and "incomplete" in err


def test_a_missing_last_data_rank_shows_in_the_centroids(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "dp2_mp1", ckpt)
    (ckpt / "7" / "mp_rank_01_00_model_states.pt").unlink()
    err = refused(capsys, tmp_path, "--from", "cpm2", ckpt, "--model-config", CONFIG)
    assert "mp_rank_00_00_model_states.pt" in err and "2 experts" in err
    assert "1 data-parallel files" in err


def test_a_config_with_another_expert_count(tmp_path, capsys):
    config, _, _, _ = read("dp2_mp1")
    values = {**config.to_dict(), "num_experts": 4}
    path = tmp_path / "ours.json"
    path.write_text(json.dumps(values))
    err = refused(capsys, tmp_path, "--from", "cpm2", FIXTURE / "dp2_mp1", "--model-config",
                  path)
    assert "--model-config" in err and "num_experts 4" in err and "2 experts" in err


def test_an_expert_parallel_size_that_does_not_divide(tmp_path, capsys):
    err = refused(capsys, tmp_path, "--from", "cpm2", FIXTURE / "dp2_mp1", "--model-config",
                  CONFIG, "--target-expert-parallel-size", 3, code=2)
    assert "--target-expert-parallel-size 3" in err and "2 experts" in err


@pytest.mark.parametrize("argv,expect", [
    (("--target-tensor-parallel-size", 3), "--target-tensor-parallel-size 3 does not divide"),
    (("--num-experts", 2), "needs --moe-router-type cpm2"),
])
def test_what_cpm2_moe_cannot_hold(argv, expect, tmp_path, capsys):
    source = ("--from", "cpm2", DENSE / "mp1", "--model-config", DENSE / "config.json") \
        if "--num-experts" in argv else ("--from", "cpm2", FIXTURE / "dp2_mp1",
                                         "--model-config", CONFIG)
    err = refused(capsys, tmp_path, *source, *argv, code=2, to="cpm2")
    assert expect in err


def test_a_dense_model_is_not_written_as_cpm2_moe(tmp_path, capsys):
    err = refused(capsys, tmp_path, "--from", "cpm2", DENSE / "mp1", "--model-config",
                  DENSE / "config.json", code=2, to="cpm2")
    assert "router_type 'cpm2'" in err


def test_a_centroid_gain_without_cpm2_routing(tmp_path, capsys):
    out = tmp_path / "out"
    assert convert("--from", "cpm2", DENSE / "mp1", "--model-config", DENSE / "config.json",
                   "--num-experts", 2, "--moe-centroid-gain", 0.1, "--to", "megatron",
                   out) == 2
    assert "--moe-centroid-gain needs" in capsys.readouterr().err and not out.exists()


# An imported checkpoint continues with CPM-2's losses ---------------------------------------
def continue_training(rank, world_size, folder, fields, data):
    """The trainer's model, router 'cpm2', at EP = DP = 2 (one expert per rank, as CPM-2), loaded
    from the converted checkpoint as the trainer loads it, then CPM-2's steps: their batches,
    their gradient scaling, torch's Adam. The mean of the ranks' losses before each step, and
    this rank's first-step gradients of GRADS (CPM-2's names)."""
    import torch.distributed as dist

    from megatron import parallel_state
    from megatron.checkpoint.formats.weights import WeightsReader, load_into
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import persistent_buffers

    parallel_state.initialize_model_parallel(1, 1, world_size)
    model = T5Model(T5Config(**fields), attention_backend="eager",
                    make_vocab_size_divisible_by=1).train()
    problems = load_into(model, {n: n for n, _ in model.named_parameters()},
                         WeightsReader(folder), fields["vocab_size"], 0, 1,
                         buffers={n: n for n in persistent_buffers(model)},
                         experts=(rank, world_size))
    assert not problems, problems
    optimizer = torch.optim.Adam(model.parameters(), lr=data["lr"], betas=data["betas"],
                                 eps=data["eps"], weight_decay=data["weight_decay"])
    losses, grads = [], {}
    params = dict(model.named_parameters())
    for step in range(data["losses"].shape[0]):
        labels = data["labels"][step, rank].masked_fill(data["loss_mask"][step, rank] == 0,
                                                        -100)
        out = model(data["enc_input_ids"][step, rank], data["dec_input_ids"][step, rank],
                    labels=labels)
        out.loss.backward()
        for p in model.parameters():
            # CPM-2's allreduce_params(reduce_after=False): the shared weights' gradients
            # averaged over data parallel; the experts' left as the all-to-all's backward
            # brings them (the gradient of the SUM of the ranks' losses; our trainer divides
            # it by DP). One expert per rank: nothing else holds it.
            if not getattr(p, "expert_parallel", False):
                dist.all_reduce(p.grad)
                p.grad /= world_size
        if step == 0:
            grads = {theirs: params[ours].grad.clone() for theirs, ours in GRADS.items()}
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return torch.tensor(losses, dtype=torch.float64), grads


GRADS = {"encoder.blocks.0.ff.expert_network.dense_relu_dense.wo.weight":
         "encoder.block.0.layer.1.mlp.experts.wo",
         "decoder.blocks.1.ff.expert_network.dense_relu_dense.wi_0.weight":
         "decoder.block.1.layer.2.mlp.experts.wi_0",
         "encoder.blocks.0.ff.expert_network.layer_norm.weight":
         "encoder.block.0.layer.1.layer_norm.weight",
         "decoder.blocks.1.self_attn.self_attn.dense.weight":
         "decoder.block.1.layer.0.SelfAttention.o.weight"}
"""Their gradients kept by make_fixture.py -> ours: two experts' (the sum over the ranks'
losses), the shared layer norm's and an attention weight's (averaged)."""


@pytest.mark.slow
def test_an_imported_checkpoint_continues_with_cpm2s_losses(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from harness import run_workers

    ours = tmp_path / "ours"
    assert convert("--from", "cpm2", FIXTURE / "dp2_mp1", "--model-config", CONFIG,
                   "--tokenizer-path", FIXTURE / "vocab.txt", "--to", "megatron", ours,
                   "--target-expert-parallel-size", EXPERTS) == 0
    fields = json.loads((ours / "model_config.json").read_text())
    data = torch.load(FIXTURE / "dp2_mp1" / "continuation.pt", weights_only=True)
    got = run_workers(EXPERTS, continue_training, find_iteration(ours), fields, data,
                      timeout=300)
    for rank, (losses, grads) in enumerate(got):
        torch.testing.assert_close(losses, data["losses"], rtol=1e-5, atol=0)
        # Adam hardly sees a constant factor on a gradient (only through eps): the gradients
        # check the scaling itself (an expert's divided by DP would be half of theirs)
        for name, grad in grads.items():
            want = data["first_step_grads"][name][rank]
            torch.testing.assert_close(grad.reshape(want.shape), want, rtol=1e-4,
                                       atol=1e-5 * want.abs().max().item(), msg=name)
