"""Adam's states through the conversion tool without processes: a one-process ZeRO-0 checkpoint
made here with a real torch AdamW after one step (the trainer's parameter groups), read back
against the optimizer's own state; carried by `--to megatron` (and again from the converted
checkpoint, bit for bit); left out, with a warning, where the source cannot give them.
Real runs resumed in other layouts: tests/training/test_reshard.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from data_tools import convert_checkpoint
from megatron.checkpoint.formats.deepspeed import (
    check_optimizer_states,
    describe,
    find_iteration,
    iter_full_tensors,
    optimizer_step,
)
from megatron.checkpoint.formats.deepspeed_files import OPTIMIZER_PARAMETERS
from megatron.model.config import T5Config
from megatron.model.t5 import T5Model
from megatron.training.engine import param_groups

CONFIG = dict(vocab_size=100, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
DIVISIBLE = 8  # 100 rows padded to 104
LR_SCHEDULE = {"max_lr": 1e-3, "min_lr": 0.0, "warmup_steps": 1, "decay_steps": 10,
               "decay_style": "linear"}


def write_checkpoint(root, record=True, precision="fp32", steps=2):
    """A ZeRO-0 checkpoint as the trainer writes it, after `steps` AdamW steps; returns
    {state key: {our name: unpadded tensor}} for 'exp_avg', 'exp_avg_sq' and the weights."""
    torch.manual_seed(0)
    net = T5Model(T5Config(**CONFIG), DIVISIBLE)
    groups = param_groups(net, 0.01)
    adam = torch.optim.AdamW(groups, lr=1e-3)
    for _ in range(steps):
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        adam.step()
    names = {id(p): n for n, p in net.named_parameters()}
    folder = root / "iter_0000003"
    folder.mkdir(parents=True)
    state = {"module": {k: v.clone() for k, v in net.state_dict().items()},
             "buffer_names": [], "optimizer": adam.state_dict(), "param_shapes": None,
             "ds_version": "0.19.8", "iteration": 3}
    if record:
        state[OPTIMIZER_PARAMETERS] = [[names[id(p)] for p in g["params"]] for g in groups]
    torch.save(state, folder / "mp_rank_00_model_states.pt")
    config = T5Config(**CONFIG)
    meta = {"iteration": 3, "consumed_samples": 12, "lr_schedule": LR_SCHEDULE,
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                       "data_parallel_size": 1, "zero_stage": 0},
            "model": {"config": config.to_dict(), "make_vocab_size_divisible_by": DIVISIBLE,
                      "precision": precision}}
    (folder / "meta.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")

    def unpad(name, tensor):
        return tensor[:100] if name in ("shared.weight", "lm_head.weight") else tensor

    want = {key: {n: unpad(n, adam.state[p][key]) for n, p in net.named_parameters()}
            for key in ("exp_avg", "exp_avg_sq")}
    want["weights"] = {n: unpad(n, p.detach()) for n, p in net.named_parameters()}
    return want


def test_adam_states_read_as_the_optimizer_holds_them(tmp_path):
    want = write_checkpoint(tmp_path / "ckpt")
    folder = find_iteration(tmp_path / "ckpt")
    assert optimizer_step(folder) == 2 and check_optimizer_states(folder) == 2
    for key in ("exp_avg", "exp_avg_sq"):
        got = dict(iter_full_tensors(folder, key))
        assert list(got) == list(want[key])
        for name, tensor in got.items():
            assert torch.equal(tensor, want[key][name]), (key, name)
    info = describe(folder)
    assert info["optimizer_step"] == 2 and info["optimizer_states_convertible"] is True


def test_to_megatron_carries_them_and_again_from_the_result(tmp_path, capsys):
    want = write_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "tp2"
    assert convert_checkpoint.main(["--load", str(tmp_path / "ckpt"), "--to", "megatron",
                                    str(out), "--target-tensor-parallel-size", "2",
                                    "--no-progress"]) == 0
    assert "with the optimizer states (Adam step 2)" in capsys.readouterr().out
    folder = out / "iter_0000003"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["optimizer"] == {"step": 2, "states": ["exp_avg", "exp_avg_sq"]}
    assert (meta["iteration"], meta["consumed_samples"], meta["lr_schedule"]) == \
        (3, 12, LR_SCHEDULE)
    files = {"weights": "model", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    for key, prefix in files.items():
        got = load_file(folder / f"{prefix}.safetensors")
        assert sorted(got) == sorted(want[key])
        assert all(torch.equal(got[n], t) for n, t in want[key].items()), key
    again = tmp_path / "again"
    assert convert_checkpoint.main(["--load", str(out), "--to", "megatron", str(again),
                                    "--no-progress"]) == 0
    for prefix in files.values():
        a = load_file(folder / f"{prefix}.safetensors")
        b = load_file(again / "iter_0000003" / f"{prefix}.safetensors")
        assert all(torch.equal(a[n], b[n]) for n in a) and a.keys() == b.keys()
    assert json.loads((again / "iter_0000003" / "meta.json").read_text())["optimizer"]["step"] \
        == 2


@pytest.mark.parametrize("case,reason", [
    ("no_record", "no 'optimizer_parameters' record"),
    ("fp16", "fp16 with ZeRO-0 keeps its optimizer inside DeepSpeed's fp16 optimizer"),
    ("weights_only", None),
])
def test_weights_only_where_the_states_cannot_come(tmp_path, capsys, case, reason):
    write_checkpoint(tmp_path / "ckpt", record=case != "no_record",
                     precision="fp16" if case == "fp16" else "fp32")
    out = tmp_path / "out"
    extra = ["--weights-only"] if case == "weights_only" else []
    assert convert_checkpoint.main(["--load", str(tmp_path / "ckpt"), "--to", "megatron",
                                    str(out), "--no-progress", *extra]) == 0
    captured = capsys.readouterr()
    if case == "fp16":
        assert "reading the fp16 weights" in captured.err
    if reason:
        assert "warning: the optimizer states cannot be carried" in captured.err
        assert reason in captured.err
    else:
        assert "warning" not in captured.err
    meta = json.loads((out / "iter_0000003" / "meta.json").read_text())
    assert "optimizer" not in meta and meta["files"] == ["model.safetensors"]
    assert "--finetune" in captured.out
