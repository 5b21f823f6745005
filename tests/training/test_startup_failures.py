"""A job that cannot run says so once and leaves nothing behind, under a real torchrun with two
ranks: bad data (a truncated .bin, a missing prefix) and a resume that contradicts its
checkpoint are refused by every rank while the flags are checked, before any process group,
model or DeepSpeed exists; rank 0 prints the one message, the others stay silent, and no --save
folder is created. (A second job on a held --save: tests/launch/test_ownership.py; a
non-finite step: tests/training/test_nan_locator.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port
from train_workers import base_argv

REPO = Path(__file__).resolve().parents[2]
REFUSED = "the command line cannot run"


def torchrun(argv, cwd, module="megatron.pretrain_t5") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--master_port", str(free_port()), "-m", module,
                           *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_refused_once(proc, *names):
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert proc.stderr.count(REFUSED) == 1, output[-3000:]
    for name in names:
        assert name in proc.stderr, output[-3000:]
    assert not re.search(r"\[rank\d+\]: *Traceback", output), output[-3000:]
    # refused before DeepSpeed's communication backend started (it says so when it does)
    assert "built successfully" not in output, output[-3000:]


@pytest.mark.slow
def test_bad_data_is_refused_once_before_anything_starts(train_data, tmp_path):
    truncated = tmp_path / "half_text_document"
    shutil.copy(train_data.prefix + ".idx", str(truncated) + ".idx")
    data = Path(train_data.prefix + ".bin").read_bytes()
    Path(str(truncated) + ".bin").write_bytes(data[:len(data) // 2])
    save = tmp_path / "save"
    for prefix, message in ((truncated, "truncated?"),
                            (tmp_path / "nothing_text_document", "no .bin/.idx pair")):
        argv = base_argv(train_data, "--save", str(save), "--log-file", str(tmp_path / "log"))
        argv[argv.index("--data-path") + 1] = str(prefix)
        proc = torchrun(argv, tmp_path)
        assert_refused_once(proc, str(prefix), message)
        assert not save.exists() and not (tmp_path / "log").exists()


@pytest.mark.slow
def test_a_resume_that_contradicts_its_checkpoint_is_refused_once(train_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), iters=2)
    done = torchrun(argv, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = sorted(p.name for p in ckpt.iterdir())
    longer = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), iters=5)
    proc = torchrun(longer, tmp_path)
    assert_refused_once(proc, "the learning-rate schedule in the checkpoint differs",
                        "--use-new-lr")
    assert sorted(p.name for p in ckpt.iterdir()) == before


@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_once_and_an_earlier_one_loads(train_data, tmp_path):
    """A file a rank needs deleted from the newest checkpoint (this rank's RNG states; the model
    file): refused once with exit 2 before any rank starts (no rank 0 "resumed from" then gloo
    errors), naming the file and the earlier complete iteration, also in --log-file; that
    iteration then loads with --ckpt-step, and the run saves the newest iteration again."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    argv = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval",
                     "2", "--log-file", str(log), iters=4)
    done = torchrun(argv, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rng = ckpt / "iter_0000004" / "rng" / "rank_00001.pt"
    rng.unlink()
    earlier = "iteration 2 is complete: resume from it with --ckpt-step 2"
    proc = torchrun(argv, tmp_path)
    assert_refused_once(proc, f"{rng} is missing", earlier)
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr[-3000:]  # torchrun's: 1
    assert "resumed from" not in proc.stdout + proc.stderr
    assert f"{rng} is missing" in log.read_text()

    resumed = torchrun(argv + ["--ckpt-step", "2"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpt} at iteration 2 " in resumed.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4\n" and rng.is_file()

    model = ckpt / "iter_0000004" / "mp_rank_00_model_states.pt"
    model.unlink()
    proc = torchrun(argv, tmp_path)
    assert_refused_once(proc, f"{model} is missing", earlier)


def test_single_process_runs_and_a_master_port_in_use(train_data, tmp_path):
    """A plain `python -m megatron.pretrain_t5` without MASTER_PORT trains on a port its store
    picked (29500 was fixed: a second run on the host died with a 30-line EADDRINUSE
    traceback); one with a MASTER_PORT in use says so in one line, exit 2, writing nothing."""
    import socket

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "SLURM_",
                                "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "megatron.pretrain_t5",
            *base_argv(train_data, "--log-file", str(tmp_path / "log"), iters=1,
                       model=train_data.tiny)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = subprocess.run(argv, cwd=tmp_path, env={**env, "MASTER_PORT": str(port)},
                                 capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: MASTER_PORT {port} is in use on 127.0.0.1 (another job or run "
                      f"listens there): set MASTER_PORT to a free port, or unset it: a run "
                      f"without a launcher then takes a free one"], refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and not (tmp_path / "log").exists()
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"iteration +1/ *1 \|.*loss: ", done.stdout), done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["megatron.pretrain_t5", "megatron.generate"])
def test_an_unknown_flag_under_torchrun_is_one_line_from_rank_0(module, train_data, tmp_path):
    """Two ranks, an unknown flag from Megatron-LM: one line naming it (and, for the trainer,
    its replacement; the usage text on every rank before: 294 lines), printed by rank 0 only;
    both ranks exit 2,
    which torchrun reports in its exitcode lines (its own status stays 1,
    docs/troubleshooting.md)."""
    argv = base_argv(train_data) if module == "megatron.pretrain_t5" else \
        ["--load", str(tmp_path), "--input", __file__, "--output", str(tmp_path / "out")]
    proc = torchrun([*argv, "--use-distributed-optimizer"], tmp_path, module)
    mentions = [line for line in proc.stderr.splitlines()
                if "--use-distributed-optimizer" in line]
    assert len(mentions) == 1, proc.stderr[-3000:]
    if module == "megatron.generate":  # (the trainer's list has its header line above it)
        assert mentions[0] == "error: unknown flag --use-distributed-optimizer (python -m " \
            "megatron.generate --help lists every flag)"
    else:
        assert "use --zero-stage 1 or higher (docs/migrating.md)" in mentions[0]
    assert "usage:" not in proc.stderr and not re.search(r"\[rank\d+\]: *Traceback",
                                                          proc.stderr)
    assert proc.returncode == 1
    statuses = re.findall(r"exitcode *: (-?\d+) ", proc.stderr)
    assert "2" in statuses and set(statuses) <= {"2", "-15"}, proc.stderr[-3000:]
