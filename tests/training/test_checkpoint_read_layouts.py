"""megatron/checkpoint/formats/deepspeed.py reads the checkpoints of real short runs in every layout:
one process fp32 ZeRO-0 (its module file is the full state: bit-equal), DP=2 ZeRO-1/2/3 (and
ZeRO-3 with optimizer and parameters offloaded), TP=2 ZeRO-1, PP=2 ZeRO-0/1, TP=2 x PP=2 tied,
PP=2 x DP=2, bf16 ZeRO-1 with and without a pipeline (DeepSpeed's two bf16 optimizers).

The parallel runs reach the one-process run's weights within fp32 noise. The model has an odd
d_model (31) and one decoder block (nine norms), so DeepSpeed pads: ZeRO-3 every odd-sized
parameter, ZeRO-1/2 and the BF16 optimizer the groups (checked below)."""

import json
import shutil

import pytest
import torch

from harness import run_workers
from train_workers import base_argv, run_pretrain

from megatron.checkpoint.formats.deepspeed import (
    CheckpointReadError,
    describe,
    find_iteration,
    iter_full_tensors,
)

pytestmark = pytest.mark.slow

FP32_LAYOUTS = {
    "dp2_z1": (2, ["--zero-stage", "1"]),
    "dp2_z2": (2, ["--zero-stage", "2"]),
    "dp2_z3": (2, ["--zero-stage", "3"]),
    "dp2_z3_offload": (2, ["--zero-stage", "3", "--offload-optimizer", "cpu",
                           "--offload-param", "cpu"]),
    "tp2_z1": (2, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]),
    "pp2_z0": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2_z1": (2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
    "pp2_dp2_z1": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
    "tp2_pp2_z1_tied": (4, ["--tensor-model-parallel-size", "2",
                            "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
}
BF16_LAYOUTS = {
    "dp2_bf16_z1": (2, ["--bf16", "--zero-stage", "1"]),  # DeepSpeedZeroOptimizer
    "pp2_bf16_z1": (2, ["--bf16", "--zero-stage", "1",  # BF16_Optimizer
                        "--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def checkpoints(train_data, tmp_path_factory):
    """{name: checkpoint folder}: 'one' and 'one_tied' (one process, fp32, ZeRO-0) and every
    layout above, 2 steps each, one run_workers call per world size."""
    root = tmp_path_factory.mktemp("checkpoints")
    config = json.loads(open(train_data.tiny).read())
    models = {}
    for tied in (False, True):
        path = root / f"odd{'_tied' if tied else ''}.json"
        path.write_text(json.dumps({**config, "d_model": 31, "num_decoder_layers": 1,
                                    "tie_word_embeddings": tied}))
        models[tied] = str(path)

    def argv(name, extra):
        return base_argv(train_data, *extra, "--save", str(root / name),
                         model=models[name.endswith("tied")], iters=2)

    layouts = {"one": (1, []), "one_tied": (1, []), **FP32_LAYOUTS, **BF16_LAYOUTS}
    for world in (1, 2, 4):
        runs = [argv(n, extra) for n, (w, extra) in layouts.items() if w == world]
        run_workers(world, run_pretrain, runs, timeout=1200)
    return {name: root / name for name in layouts}


def read(folder, source="master"):
    return dict(iter_full_tensors(find_iteration(folder), source))


@pytest.fixture(scope="module")
def initial(checkpoints):
    """{'odd' | 'odd_tied': the full weights every run started from}: built here as the trainer
    builds them (set_seeds, then the model; each layer draws from its own stream, so the layout
    does not matter)."""
    from megatron.initialize import set_seeds
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import gather_full_state_dict

    out = {}
    for name in ("odd", "odd_tied"):
        config = json.loads((checkpoints["one"].parent / f"{name}.json").read_text())
        set_seeds(7, "cpu")  # base_argv's --seed
        out[name] = gather_full_state_dict(T5Model(T5Config(**config)))
    return out


def update_difference(got, want, start, start_got=None):
    """{name: |got's update - want's update| / |want's update|}: updates from `start` (the
    run's own start `start_got`, if it differs: a bf16 run's masters begin as the bf16 copy)."""
    start_got = start if start_got is None else start_got
    return {k: float((got[k] - start_got[k] - (want[k] - start[k])).norm()
                     / (want[k] - start[k]).norm()) for k in want}


def reference(checkpoints, name):
    return read(checkpoints["one_tied" if name.endswith("tied") else "one"], "weights")


def test_one_process_output_is_its_module_file_unpadded(checkpoints):
    folder = find_iteration(checkpoints["one"])
    module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    vocab = json.loads((folder / "meta.json").read_text())["model"]["config"]["vocab_size"]
    for source in ("master", "weights"):
        got = read(checkpoints["one"], source)
        assert list(got) == list(module)  # the model's order, every parameter
        for name, tensor in module.items():
            want = tensor[:vocab] if name in ("shared.weight", "lm_head.weight") else tensor
            assert torch.equal(got[name], want), name
            assert got[name].untyped_storage().nbytes() == want.numel() * 4, name  # no padding


@pytest.mark.parametrize("name", sorted(FP32_LAYOUTS))
def test_parallel_layouts_give_the_one_process_weights(checkpoints, initial, name):
    """Masters within fp32 noise of one process: each tensor's update of the two steps within
    1e-3 of the one-process update, by norm (measured: 1e-4 at most, TP 2's embedding; Adam
    makes an element with a near-zero gradient swing with the summation order, so elementwise
    bounds depend on the CPU); under fp32 the weights are the masters."""
    want = reference(checkpoints, name)
    master, weights = read(checkpoints[name]), read(checkpoints[name], "weights")
    assert list(master) == list(weights) == list(want)
    for key in want:
        assert master[key].dtype == weights[key].dtype == torch.float32
        assert torch.equal(master[key], weights[key]), key
    start = initial["odd_tied" if name.endswith("tied") else "odd"]
    worst = update_difference(master, want, start)
    assert max(worst.values()) < 1e-3, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("name", sorted(BF16_LAYOUTS))
def test_bf16_masters_are_fp32_and_differ_from_the_weights(checkpoints, initial, name):
    """fp32 masters; the bf16 weights are the masters rounded (DeepSpeed copies them after
    every step) and lose what the masters keep. The masters' update of the two steps (from the
    bf16 start they are copied from) is the fp32 run's within bf16's noise: each tensor within
    0.25 of it by norm (measured: 0.10 at most, 0.02 typically), which masters that were never
    updated (1.0) or updated twice as far miss."""
    master, weights = read(checkpoints[name]), read(checkpoints[name], "weights")
    want = reference(checkpoints, name)
    assert list(master) == list(weights) == list(want)
    differ = 0
    for key in want:
        assert master[key].dtype == torch.float32 and weights[key].dtype == torch.bfloat16
        assert torch.equal(master[key].to(torch.bfloat16), weights[key]), key
        differ += int(not torch.equal(master[key], weights[key].float()))
    assert differ == len(want)
    start = initial["odd"]
    bf16_start = {k: v.to(torch.bfloat16).float() for k, v in start.items()}
    worst = update_difference(master, want, start, bf16_start)
    assert max(worst.values()) < 0.25, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_describe(checkpoints):
    info = describe(find_iteration(checkpoints["pp2_bf16_z1"]))
    assert info["iteration"] == 2 and info["consumed_samples"] == 8 and not info["problems"]
    assert info["layout"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                              "data_parallel_size": 1, "zero_stage": 1}
    assert info["precision"] == "bf16" and info["optimizer_states"]
    assert info["dtypes"] == {"weights": "bfloat16", "master": "float32"}
    assert info["parameters"] == sum(t.numel() for t in reference(checkpoints, "one").values())
    names = {f["name"] for f in info["files"]}
    assert {"pipeline_layers.json", "tied_shared-model_00-model_states.pt",
            "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"} <= names
    assert info["total_bytes"] == sum(f["bytes"] for f in info["files"])
    assert info["pipeline_layers"]["layers"][0] == "shared"
    one = describe(find_iteration(checkpoints["one"]))
    assert one["optimizer_states"] and one["dtypes"] == {"weights": "float32",
                                                        "master": "float32"}


def test_damaged_files_are_named(checkpoints, tmp_path):
    """A truncated ZeRO file and a missing one: the error names the file; --inspect lists them
    as problems instead of failing."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["dp2_z3"], folder)
    iteration = find_iteration(folder)
    target = iteration / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    target.write_bytes(target.read_bytes()[:1000])
    with pytest.raises(CheckpointReadError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                                  "cannot be read .*truncated"):
        read(folder)
    target.unlink()
    with pytest.raises(CheckpointReadError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                                  "missing"):
        read(folder)
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt" in p
               for p in describe(iteration)["problems"])


def test_the_layouts_exercise_deepspeeds_padding(checkpoints):
    """The claims of the module docstring hold: ZeRO-3 pads odd-sized parameters, ZeRO-1/2
    strip a group's trailing padding (odd group sizes), BF16_Optimizer saves it."""
    from megatron.checkpoint.formats.deepspeed import load_file

    def state(name, file):
        return load_file(find_iteration(checkpoints[name]) / file)

    shapes = state("dp2_z3", "zero_pp_rank_0_mp_rank_00_model_states.pt")["param_shapes"]
    assert any(s.numel() % 2 for group in shapes for s in group.values())
    zero1 = state("dp2_z1", "zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert any(p.numel() % 2 for p in zero1["single_partition_of_fp32_groups"])
    assert any(zero1["group_paddings"])
    stages = [state("pp2_bf16_z1", f"bf16_zero_pp_rank_0_mp_rank_{m:02d}_optim_states.pt")
              ["optimizer_state_dict"] for m in range(2)]
    assert all("zero_stage" not in s for s in stages)  # BF16_Optimizer
    assert any(any(s["group_paddings"]) for s in stages)
