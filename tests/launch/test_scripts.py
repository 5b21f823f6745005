"""The launch scripts without Slurm: syntax, their checks of the environment, the GPU examples'
flags (validated by the entry point's --dry-run for the cluster sizes they are written for) and
torchrun.sh running the tiny example, SIGUSR1 included."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launching import losses, read, tail, tiny_env

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([REPO / "launch/torchrun.sh", REPO / "launch/slurm/pretrain_t5.sbatch",
                  REPO / "launch/slurm/preprocess.sbatch", REPO / "launch/slurm/srun_per_device.sh",
                  *(REPO / "launch/examples").glob("*.sh")])
DRY_RUN = f"{sys.executable} -m megatron.pretrain_t5 --dry-run"


def bash(script: Path, *args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "DATA", "TOKENIZER", "MODEL_CONFIG", "OUT",
                                  "NNODES", "MASTER_", "RDZV_", "LAUNCHER", "WORLD_SIZE"))}
    return subprocess.run(["bash", str(script), *args], env={**clean, **(env or {})}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_syntax_and_executable(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("name", ["tiny_cpu.sh", "t5_base.sh", "t5_v1_1_xl_tp_zero3.sh",
                                  "cpm2_11b_fp32_zero3.sh", "switch_base_8.sh",
                                  "cpm2_moe_198b.sh", "cpm2_stage1_chinese.sh"])
def test_examples_name_missing_settings(name, tmp_path):
    proc = bash(REPO / "launch/examples" / name)
    assert proc.returncode == 2
    assert "error: set DATA" in proc.stderr and "OUT" in proc.stderr
    proc = bash(REPO / "launch/examples" / name, env={
        "DATA": str(tmp_path / "nothing"), "TOKENIZER": str(tmp_path / "no.model"),
        "MODEL_CONFIG": str(tmp_path / "no.json"), "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    assert str(tmp_path) in proc.stderr and "not found" in proc.stderr


@pytest.mark.parametrize("name, world_size, expect", [
    ("t5_base.sh", 8, "TP 1 x PP 1 x DP 8"),
    ("t5_base.sh", 64, "TP 1 x PP 1 x DP 64"),
    ("t5_v1_1_xl_tp_zero3.sh", 64, "TP 2 x PP 1 x DP 32"),
    ("cpm2_11b_fp32_zero3.sh", 64, "TP 1 x PP 1 x DP 64"),
    ("switch_base_8.sh", 32, "TP 1 x PP 1 x DP 32"),
    ("cpm2_moe_198b.sh", 128, "TP 4 x PP 1 x DP 32"),
    ("cpm2_stage1_chinese.sh", 128, "TP 4 x PP 1 x DP 32"),
])
def test_gpu_examples_pass_the_dry_run(name, world_size, expect, tiny_data, tmp_path):
    proc = bash(REPO / "launch/examples" / name, env={
        "DATA": tiny_data.prefix, "TOKENIZER": tiny_data.spm, "OUT": str(tmp_path / "out"),
        "LAUNCHER": DRY_RUN, "WORLD_SIZE": str(world_size)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"valid for {world_size} processes ({expect})" in proc.stdout


def test_cpm2_example_takes_the_bpe_cn_folder(tiny_data, tmp_path):
    """TOKENIZER=bpe_cn, CPM-2's folder with its vocab.txt: read with CPM-2's tokenizer (the
    data made with it: data made with another tokenizer is refused)."""
    from data_tools import preprocess_data

    corpus = Path(tiny_data.prefix).parent / "corpus.jsonl"
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix",
                                 str(tmp_path / "zh"), "--tokenizer-path",
                                 str(REPO / "tests/data/cpm2/bpe_cn"), "--append-eod",
                                 "--workers", "1", "--no-progress"]) == 0
    env = {"DATA": str(tmp_path / "zh_text_document"), "OUT": str(tmp_path / "out"),
           "LAUNCHER": DRY_RUN, "WORLD_SIZE": "64"}
    script = REPO / "launch/examples/cpm2_11b_fp32_zero3.sh"
    proc = bash(script, env={**env, "TOKENIZER": str(REPO / "tests/data/cpm2/bpe_cn")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid for 64 processes (TP 1 x PP 1 x DP 64)" in proc.stdout
    (tmp_path / "empty").mkdir()
    proc = bash(script, env={**env, "TOKENIZER": str(tmp_path / "empty")})
    assert proc.returncode == 2 and "neither CPM-2's vocab.txt nor a SentencePiece" in proc.stderr


# CPM-2's stages 2 and 3 (docs/cpm2-stages.md) start from the previous stage's converted
# checkpoint (INIT); in CI, MODEL_CONFIG stands in for it (random weights, the same flags).
CPM2_LATER_STAGES = ["cpm2_stage2_bilingual.sh", "cpm2_stage3_moe.sh"]


def stage_env(tiny_data, tmp_path, **extra) -> dict:
    return {"DATA_EN": tiny_data.prefix, "DATA_ZH": tiny_data.prefix,
            "TOKENIZER": tiny_data.spm, "OUT": str(tmp_path / "out"), "INIT": "", **extra}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "launch/examples").glob("*.sh")
                                         if p.name != "common.sh"))
def test_examples_create_nothing_before_the_launcher(name, tiny_data, tmp_path):
    """Under --dry-run (given to the script or in LAUNCHER) a script makes no OUT: no empty
    folder is left behind. Otherwise it makes OUT for the launcher (sbatch --output=OUT/...
    opens its file before the trainer starts: tests/launch/test_slurm.py)."""
    env = {**stage_env(tiny_data, tmp_path), "DATA": tiny_data.prefix,
           "MODEL_CONFIG": tiny_data.config, "LAUNCHER": "echo"}
    proc = bash(REPO / "launch/examples" / name, "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout
    assert not (tmp_path / "out").exists()
    proc = bash(REPO / "launch/examples" / name, env={**env, "LAUNCHER": "echo --dry-run"})
    assert proc.returncode == 0 and not (tmp_path / "out").exists(), proc.stderr
    proc = bash(REPO / "launch/examples" / name, env=env)
    assert proc.returncode == 0 and (tmp_path / "out").is_dir(), proc.stderr


@pytest.mark.parametrize("name", CPM2_LATER_STAGES)
def test_cpm2_later_stages_name_missing_settings(name, tiny_data, tmp_path):
    script = REPO / "launch/examples" / name
    proc = bash(script, env={"INIT": ""})
    assert proc.returncode == 2
    assert "error: set DATA_EN DATA_ZH TOKENIZER OUT" in proc.stderr
    proc = bash(script, env=stage_env(tiny_data, tmp_path))
    assert proc.returncode == 2 and "error: set INIT" in proc.stderr
    proc = bash(script, env=stage_env(tiny_data, tmp_path, INIT=str(tmp_path / "init")))
    assert proc.returncode == 2
    assert f"{tmp_path / 'init'}/model_config.json not found" in proc.stderr
    proc = bash(script, env=stage_env(tiny_data, tmp_path, DATA_EN=str(tmp_path / "en"),
                                      MODEL_CONFIG=str(REPO / "configs/model/cpm2-11b.json")))
    assert proc.returncode == 2 and f"no {tmp_path / 'en'}*.idx" in proc.stderr


@pytest.mark.parametrize("name", CPM2_LATER_STAGES)
def test_cpm2_later_stages_blend_and_start_from_init(name, tiny_data, tmp_path):
    """The 1:2 English:Chinese blend as --data-path weights; INIT loaded with --finetune, its
    model_config.json the model's, until OUT has a checkpoint, which is then resumed."""
    init = tmp_path / "init"
    init.mkdir()
    (init / "model_config.json").write_text("{}")
    english = tmp_path / "en_text_document"
    for suffix in (".bin", ".idx"):
        os.symlink(tiny_data.prefix + suffix, f"{english}{suffix}")
    env = stage_env(tiny_data, tmp_path, INIT=str(init), DATA_EN=str(english), LAUNCHER="echo")
    proc = bash(REPO / "launch/examples" / name, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"--data-path 1 {english} 2 {tiny_data.prefix} " in proc.stdout
    assert f"--model-config {init}/model_config.json " in proc.stdout
    assert f"--load {init} --finetune " in proc.stdout
    ckpt = tmp_path / "out/ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1000")
    proc = bash(REPO / "launch/examples" / name, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"--load {ckpt} " in proc.stdout and "--finetune" not in proc.stdout


def test_cpm2_stage2_passes_the_dry_run(tiny_data, tmp_path):
    proc = bash(REPO / "launch/examples/cpm2_stage2_bilingual.sh", env=stage_env(
        tiny_data, tmp_path, MODEL_CONFIG=str(REPO / "configs/model/cpm2-11b.json"),
        LAUNCHER=DRY_RUN, WORLD_SIZE="128"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid for 128 processes (TP 4 x PP 1 x DP 32)" in proc.stdout


@pytest.mark.parametrize("experts, world_size, expect", [
    ("4", 16, "TP 4 x PP 1 x DP 4"),    # the small world: 4 experts, one per data-parallel rank
    (None, 128, "TP 4 x PP 1 x DP 32"),  # CPM-2-MoE's 32
])
def test_cpm2_stage3_passes_the_dry_run(experts, world_size, expect, tiny_data, tmp_path):
    env = stage_env(tiny_data, tmp_path,
                    MODEL_CONFIG=str(REPO / "configs/model/cpm2-moe-198b.json"),
                    LAUNCHER=DRY_RUN, WORLD_SIZE=str(world_size))
    if experts is not None:
        env["EXPERTS"] = experts
    proc = bash(REPO / "launch/examples/cpm2_stage3_moe.sh", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"valid for {world_size} processes ({expect})" in proc.stdout
    assert f"{experts or 32} experts in 48 sparse blocks (cpm2" in proc.stdout


def test_cpm2_stage3_refuses_a_world_where_the_experts_are_not_the_data_parallel_ranks(
        tiny_data, tmp_path):
    """The cpm2 router routes over the whole data-parallel group: 4 experts (EP 4) on 128
    processes (DP 32) is refused before start, naming the flags."""
    proc = bash(REPO / "launch/examples/cpm2_stage3_moe.sh", env=stage_env(
        tiny_data, tmp_path, MODEL_CONFIG=str(REPO / "configs/model/cpm2-moe-198b.json"),
        LAUNCHER=DRY_RUN, WORLD_SIZE="128", EXPERTS="4"))
    assert proc.returncode != 0
    assert "--expert-model-parallel-size (4) must equal the data-parallel size (32)" \
        in proc.stdout + proc.stderr
    proc = bash(REPO / "launch/examples/cpm2_stage3_moe.sh", env=stage_env(
        tiny_data, tmp_path, MODEL_CONFIG=str(REPO / "configs/model/cpm2-moe-198b.json"),
        LAUNCHER=DRY_RUN, WORLD_SIZE="16", EXPERTS="four"))
    assert proc.returncode == 2 and "EXPERTS=four" in proc.stderr


def test_torchrun_sh_refuses_incomplete_settings():
    proc = bash(REPO / "launch/torchrun.sh")
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = bash(REPO / "launch/torchrun.sh", "--help", env={"NNODES": "2", "NPROC_PER_NODE": "1"})
    assert proc.returncode == 2 and "needs MASTER_ADDR" in proc.stderr
    proc = bash(REPO / "launch/torchrun.sh", "--help", env={"RDZV_ENDPOINT": "h:29400",
                                                             "NPROC_PER_NODE": "1"})
    assert proc.returncode == 2 and "RDZV_ID" in proc.stderr


def test_torchrun_sh_ends_with_the_workers_status(tiny_data, tmp_path):
    """A command line the ranks refuse: launch/torchrun.sh ends in their status, 2 (torchrun
    alone ends in 1, with a ChildFailedError traceback: megatron/torchrun.py), after rank 0's
    lines and one line of its own."""
    proc = subprocess.run(["bash", str(REPO / "launch/examples/tiny_cpu.sh"),
                           "--use-distributed-optimizer"], env=tiny_env(tiny_data, tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("unknown flag --use-distributed-optimizer") == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^torchrun: rank \d \(local rank \d on .*\) exited with status 2: the "
                     r"job ends with status 2", proc.stderr, re.M), proc.stderr[-3000:]


def test_sbatch_script_refuses_to_run_outside_slurm():
    proc = bash(REPO / "launch/slurm/pretrain_t5.sbatch", "--help")
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr
    proc = bash(REPO / "launch/slurm/pretrain_t5.sbatch", "--help", env={"REPO": "/nonexistent"})
    assert proc.returncode == 2 and "set REPO" in proc.stderr


def test_preprocess_sbatch_refuses_to_run_outside_an_array():
    script = REPO / "launch/slurm/preprocess.sbatch"
    proc = bash(script, env={"NUM_SHARDS": "4"})
    assert proc.returncode == 2 and "sbatch --array=0-3" in proc.stderr, proc.stderr
    proc = bash(script, env={"REPO": "/nonexistent", "SLURM_ARRAY_TASK_ID": "0"})
    assert proc.returncode == 2 and "set REPO" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_torchrun_sh_trains_and_survives_sigusr1(tiny_data, tmp_path):
    """Two processes through launch/torchrun.sh; SIGUSR1 to torchrun itself does not kill it (its
    default action would, orphaning the workers, which then exit within a second), so Slurm's
    preemption warning reaches the trainer with torchrun still in charge: training goes on.
    Then a plain run of the example finishes."""
    log = tmp_path / "long/log.txt"
    long = subprocess.Popen(
        ["bash", str(REPO / "launch/examples/tiny_cpu.sh"), "--eval-interval", "0",
         "--save-interval", "1000000"],
        env=tiny_env(tiny_data, tmp_path / "long", ITERS="1000000"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def wait_for_step(n: int) -> None:
        deadline = time.monotonic() + 120
        while max(losses(read(log)), default=0) < n:
            assert long.poll() is None, f"torchrun ended:\n{long.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no step {n} in time\n{tail(log)}"
            time.sleep(0.2)

    try:
        wait_for_step(2)
        os.kill(long.pid, signal.SIGUSR1)  # tiny_cpu.sh and torchrun.sh exec: this is torchrun
        signalled = max(losses(read(log)))
        wait_for_step(signalled + 3)  # torchrun alive all along, its workers still training
        assert long.poll() is None
    finally:
        if long.poll() is None:
            long.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers
            try:
                long.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(long.pid, signal.SIGKILL)
                long.wait(10)

    proc = subprocess.run(["bash", str(REPO / "launch/examples/tiny_cpu.sh")],
                          env=tiny_env(tiny_data, tmp_path / "short", ITERS="4"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "short/ckpt/latest_checkpointed_iteration.txt").read_text().strip() == "4"
