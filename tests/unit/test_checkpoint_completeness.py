"""A damaged checkpoint is named before anything starts (megatron/checkpoint/io/completeness.py):
every save records each file's size in meta.json; the check behind --load names the first
missing or short file a run needs and the newest earlier complete iteration; a checkpoint saved
without the sizes is checked for presence only and the message says so; --ckpt-step loads a
chosen iteration; the check runs again (rank 0) when the run loads, before DeepSpeed reads."""

import json
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.io.checkpointing import (
    CheckpointError,
    checkpoint_flag_problems,
    checkpoint_problems,
    load_checkpoint,
    load_iteration,
)
from megatron.config.training import CheckpointConfig

LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
          "data_parallel_size": 1, "zero_stage": 0}


class TwoTensorRanksStep:
    """What the Saver needs of a TrainStep: DeepSpeed's file names of two tensor ranks (ZeRO-0)
    and an optimizer file, written by this one process."""

    def capture(self, root, tag, iteration, snapshot_with=None):
        folder = Path(root) / tag
        folder.mkdir(parents=True, exist_ok=True)
        out = [(str(folder / f"mp_rank_{m:02d}_model_states.pt"),
                {"module": {"w": torch.full((8 + m,), float(iteration))}}) for m in range(2)]
        out.append((str(folder / "expp_rank_0_mp_rank_00_optim_states.pt"),
                    {"state": torch.zeros(3)}))
        return out


@pytest.fixture
def saved(one_process_group, tmp_path):
    """A checkpoint folder with iterations 10 and 20 saved by the real Saver."""
    from megatron.checkpoint.io.saver import Saver

    root = tmp_path / "ckpt"
    saver = Saver(TwoTensorRanksStep(), str(root), LAYOUT, "cpu", {}, timeout_s=60)
    try:
        for iteration in (10, 20):
            saver.save(iteration, 4 * iteration, {})
    finally:
        saver.close()
    return root


def problems(root, **kwargs):
    return checkpoint_problems(str(root), LAYOUT, False, **kwargs)


def test_a_save_records_every_files_size(saved):
    folder = saved / "iter_0000020"
    meta = json.loads((folder / "meta.json").read_text())
    on_disk = {p.relative_to(folder).as_posix(): p.stat().st_size
               for p in folder.rglob("*") if p.is_file() and p.name != "meta.json"}
    assert meta["file_sizes"] == on_disk
    assert {"mp_rank_01_model_states.pt", "rng/rank_00000.pt"} <= set(on_disk)
    assert problems(saved) == []


def test_a_missing_file_is_named_with_the_earlier_complete_iteration(saved):
    target = saved / "iter_0000020" / "mp_rank_01_model_states.pt"
    target.unlink()
    assert problems(saved) == [
        f"--load {saved}: the checkpoint of iteration 20 is incomplete: {target} is missing; "
        f"iteration 10 is complete: resume from it with --ckpt-step 10"]


def test_a_short_file_is_named_by_its_saved_size(saved):
    target = saved / "iter_0000020" / "mp_rank_00_model_states.pt"
    size = target.stat().st_size
    target.write_bytes(target.read_bytes()[:size - 10])  # the zip directory read cannot tell
    (saved / "iter_0000010" / "rng" / "rank_00000.pt").unlink()
    (message,) = problems(saved)
    assert f"{target} has {size - 10} bytes, the save wrote {size}" in message
    assert message.endswith(f"no earlier complete iteration in {saved}")


def test_files_the_flags_do_not_read_may_be_missing(saved):
    folder = saved / "iter_0000020"
    (folder / "rng" / "rank_00000.pt").unlink()
    assert f"{folder / 'rng' / 'rank_00000.pt'} is missing" in problems(saved)[0]
    assert problems(saved, load_rng=False) == []  # --no-load-rng
    optimizer = folder / "expp_rank_0_mp_rank_00_optim_states.pt"
    optimizer.unlink()
    assert f"{optimizer} is missing" in problems(saved, load_rng=False)[0]
    assert checkpoint_problems(str(saved), LAYOUT, True, load_rng=False) == []  # --no-load-optim
    assert checkpoint_problems(str(saved), LAYOUT, True, finetune=True) == []
    # ZeRO-3's optimizer files hold its weights: needed by every run
    meta_path = folder / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()),
                                     "layout": {**LAYOUT, "zero_stage": 3}}))
    zero3 = {**LAYOUT, "zero_stage": 3}
    assert f"{optimizer} is missing" in checkpoint_problems(str(saved), zero3, True,
                                                            finetune=True)[0]


def test_a_checkpoint_saved_without_sizes_is_checked_for_presence(saved):
    for iteration in (10, 20):
        meta_path = saved / f"iter_00000{iteration}" / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["file_sizes"]
        meta_path.write_text(json.dumps(meta))
    assert problems(saved) == []
    target = saved / "iter_0000020" / "mp_rank_01_model_states.pt"
    target.unlink()
    assert problems(saved) == [
        f"--load {saved}: the checkpoint of iteration 20 is incomplete: {target} is missing "
        f"(saved before checkpoints recorded their file sizes: only the files' presence was "
        f"checked); iteration 10 is complete: resume from it with --ckpt-step 10"]


def test_ckpt_step_loads_the_chosen_iteration(saved):
    (saved / "iter_0000020" / "mp_rank_01_model_states.pt").unlink()
    assert load_iteration(saved) == 20 and load_iteration(saved, 10) == 10
    assert problems(saved, ckpt_step=10) == []
    assert problems(saved, ckpt_step=15) == [
        f"--load {saved}: --ckpt-step 15: no folder iter_0000015; the iterations saved there: "
        f"10, 20"]


def test_ckpt_step_needs_load():
    from megatron.arguments import build_parser

    values = vars(build_parser().parse_args(["--ckpt-step", "10"]))
    assert "--ckpt-step needs --load" in checkpoint_flag_problems(values)
    values = vars(build_parser().parse_args(["--ckpt-step", "-1", "--load", "x"]))
    assert checkpoint_flag_problems(values) == ["--ckpt-step -1: give an iteration (0 or more)"]


class NoEngine:
    def load(self, *args, **kwargs):
        raise AssertionError("DeepSpeed must not read a checkpoint known to be incomplete")


def test_the_load_checks_again_before_deepspeed_reads(saved):
    """The folder may change between the check before start and the load: rank 0 checks again
    and every rank raises the same one-line error."""
    target = saved / "iter_0000020" / "rng" / "rank_00000.pt"
    target.unlink()
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(NoEngine(), CheckpointConfig(load=str(saved)), LAYOUT, "cpu")
    assert str(raised.value).startswith(f"--load {saved}: the checkpoint of iteration 20 is "
                                        f"incomplete: {target} is missing")
    assert not raised.value.rank_local


def test_a_damaged_file_of_a_checkpoint_without_sizes_is_named_at_load(saved):
    """Without the sizes, a file cut short passes the presence check; the load still names it
    (its zip directory), before DeepSpeed reads."""
    meta_path = saved / "iter_0000020" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["file_sizes"]
    meta_path.write_text(json.dumps(meta))
    target = saved / "iter_0000020" / "mp_rank_01_model_states.pt"
    target.write_bytes(target.read_bytes()[:100])
    assert problems(saved) == []
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(NoEngine(), CheckpointConfig(load=str(saved)), LAYOUT, "cpu")
    assert str(raised.value).startswith(f"{target}: truncated or damaged")
    assert str(raised.value).endswith("load an earlier iteration (--ckpt-step N)")
