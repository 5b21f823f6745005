"""The entry point as users start it: the CPM-2 seed command line under
torch.distributed.launch (unchanged but for paths and sizes), a save killed mid-write, and a
checkpoint from another layout."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port
from train_workers import base_argv

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def env():
    out = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out.pop("WORLD_SIZE", None)
    return out


def logged_losses(text: str) -> dict:
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"iteration +(\d+)/ *\d+ \|.*?loss: (\S+) \|", text)}


def test_cpm2_command_line_runs_and_resumes(train_data, tmp_path):
    """The 11B CPM-2 line of the training issue, with a tiny model, tiny data, 2 processes, and
    CPM-2's own tokenizer folder bpe_cn (its vocab.txt): the data is made from it by our
    preprocess_data.py --tokenizer-path bpe_cn, then trained, then resumed."""
    shutil.copytree(REPO / "tests" / "data" / "cpm2" / "bpe_cn", tmp_path / "bpe_cn")
    made = subprocess.run(
        [sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input",
         str(train_data.root / "corpus.jsonl"), "--output-prefix", "mix", "--tokenizer-path",
         "bpe_cn", "--append-eod", "--workers", "2", "--no-progress"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    for suffix in (".bin", ".idx"):
        os.rename(tmp_path / f"mix_text_document{suffix}",
                  tmp_path / f"mix_cpm2_t5_document{suffix}")
    (tmp_path / "enc_dec_tiny_config.json").write_text(json.dumps({
        "d_model": 32, "num_heads": 4, "d_kv": 8, "d_ff": 64, "num_layers": 2,
        "num_decoder_layers": 2, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6,
        "init_method_std": 0.02, "vocab_size": 26240, "feed_forward_proj": "gated-gelu"}))
    ds = json.loads((REPO / "configs/deepspeed/cpm2_11b_zero3_fp32.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 2
    (tmp_path / "ds_cpm2_tiny_fp32.json").write_text(json.dumps(ds))

    def line(iters):
        return [sys.executable, "-m", "torch.distributed.launch", "--nnodes", "1",
                "--node_rank", "0", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), str(REPO / "pretrain_enc_dec.py"),
                "--use-new-lr", "--min-lr", "0.0000006",
                "--model-config", "enc_dec_tiny_config.json", "--model-parallel-size", "1",
                "--batch-size", "2", "--enc-seq-length", "64", "--dec-seq-length", "32",
                "--train-iters", str(iters), "--save", "ckpt/", "--log-file", "log.txt",
                "--load", "ckpt/", "--data-path", "mix_cpm2_t5_document", "--data-impl", "mmap",
                "--split", "950,30,20", "--distributed-backend", "nccl", "--lr", "0.000002",
                "--no-load-optim", "--lr-decay-style", "linear", "--weight-decay", "1e-2",
                "--clip-grad", "1.0", "--warmup", "0.01", "--tokenizer-path", "bpe_cn",
                "--save-interval", "3", "--eval-interval", "3", "--eval-iters", "2",
                "--log-interval", "1", "--checkpoint-activations",
                "--deepspeed-activation-checkpointing", "--deepspeed", "--deepspeed_config",
                "ds_cpm2_tiny_fp32.json"]

    first = subprocess.run(line(4), cwd=tmp_path, env=env(), capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "no checkpoint in ckpt/: starting from scratch" in first.stdout
    assert "--distributed-backend nccl: no CUDA device here; using gloo" in first.stdout
    assert sorted(logged_losses(first.stdout)) == [1, 2, 3, 4]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == [
        "iter_0000003", "iter_0000004"]
    log = (tmp_path / "log.txt").read_text()
    assert "validation loss at iteration 3" in log and "test loss at iteration 4" in log
    assert '"tokenizer_model": "bpe_cn/vocab.txt", "tokenizer_type": "CPM2Tokenizer"' in log
    second = subprocess.run(line(6), cwd=tmp_path, env=env(), capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from ckpt/ at iteration 4 (16 samples consumed)" in second.stdout
    assert sorted(logged_losses(second.stdout)) == [5, 6]


def test_killed_save_leaves_previous_checkpoint(train_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "megatron.pretrain_t5",
            *base_argv(train_data, "--save", str(ckpt), "--log-interval", "1")]
    proc = subprocess.Popen(argv + ["--save-interval", "2"], cwd=tmp_path,
                            env={**env(), "MEGATRON_CHECKPOINT_TEST_PAUSE_S": "4:600"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (ckpt / "iter_0000004.tmp" / "rng").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-save: engine files written, not yet renamed
    killed_output = proc.communicate()[0]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert not (ckpt / "iter_0000004").exists()

    resumed = subprocess.run(argv + ["--load", str(ckpt)], cwd=tmp_path, env=env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at iteration 2" in resumed.stdout
    before, after = logged_losses(killed_output), logged_losses(resumed.stdout)
    assert sorted(after) == [3, 4] and all(after[i] == before[i] for i in (3, 4))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    assert not list(ckpt.glob("*.tmp"))

    # The same checkpoint on another layout is taken: --load reshards it (megatron/checkpoint/
    # io/reshard.py; tests/training/test_load_at_another_layout.py runs such loads)
    from megatron.arguments import parse_args

    for flags, env_ in ((["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "2"}),
                        (["--zero-stage", "3"], {}), ([], {"WORLD_SIZE": "2"})):
        config = parse_args(argv[3:] + ["--load", str(ckpt), *flags], env=env_)
        assert config.checkpoint.load == str(ckpt)
    # ... but the weights of a ZeRO 0-2 checkpoint load on another data-parallel size
    config = parse_args(argv[3:] + ["--load", str(ckpt), "--no-load-optim"],
                        env={"WORLD_SIZE": "2"})
    assert config.parallel.data_parallel_size == 2


@contextlib.contextmanager
def launched(cmd, cwd):
    """torchrun in its own session, killed with its workers whatever the test's outcome."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _children(pid: int) -> list:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1])


def torchrun(flags):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--standalone", "-m", "megatron.pretrain_t5", *flags]  # its own free port


def signal_rank1_at_iteration_2(flags, cwd, sig, timeout):
    """Run 2 ranks with torchrun, send `sig` to rank 1 once iteration 2 is logged; return
    (exit status, all output, seconds from the signal to the end)."""
    with launched(torchrun(flags), cwd) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"iteration +2/", line):
                os.kill(next(p for p in _children(proc.pid) if _rank_of(p) == 1), sig)
                sent = time.monotonic()
                break
        output = "".join(lines) + proc.communicate(timeout=timeout)[0]
    return proc.returncode, output, time.monotonic() - sent


@pytest.mark.parametrize("pipeline", ["1", "2"])
def test_stop_signal_to_one_rank_saves_and_resumes(train_data, tmp_path, pipeline):
    """SIGUSR1 to rank 1 only (with a pipeline: the last stage): all ranks agree at the step
    boundary, save, exit 0; the same command line with --load continues from there."""
    ckpt = tmp_path / "ckpt"
    flags = base_argv(train_data, "--save", str(ckpt), "--load", str(ckpt), "--log-interval",
                      "1", "--pipeline-model-parallel-size", pipeline, iters=400)
    status, output, _ = signal_rank1_at_iteration_2(flags, tmp_path, signal.SIGUSR1, 300)
    assert status == 0, output[-3000:]
    stopped = re.search(r"exiting at iteration (\d+): signal SIGUSR1 \(checkpoint saved\)", output)
    assert stopped, output[-3000:]
    iteration = int(stopped.group(1))
    assert 2 <= iteration < 400
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == f"{iteration}\n"
    resumed = subprocess.run(torchrun(flags + ["--exit-interval", str(iteration + 2)]),
                             cwd=tmp_path, env=env(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at iteration {iteration} " in resumed.stdout
    assert sorted(logged_losses(resumed.stdout)) == [iteration + 1, iteration + 2]


@pytest.mark.parametrize("pipeline", ["1", "2"])
def test_a_stopped_rank_ends_the_job_within_the_timeout(train_data, tmp_path, pipeline):
    """Rank 1 frozen (SIGSTOP) mid-run (with a pipeline: the last stage): rank 0's watchdog
    names the collective it waited for and, with a pipeline, its stage, prints its stacks and
    exits; torchrun then takes the job down, non-zero, in bounded time."""
    flags = base_argv(train_data, "--log-interval", "1", "--distributed-timeout-minutes", "0.1",
                      "--pipeline-model-parallel-size", pipeline, iters=400)
    status, output, seconds = signal_rank1_at_iteration_2(flags, tmp_path, signal.SIGSTOP, 240)
    assert status != 0
    assert seconds < 90, output[-3000:]
    place = r" \(pipeline stage 0 of 2, tensor rank 0, data-parallel rank 0\)" \
        if pipeline == "2" else ""
    assert re.search(rf"rank 0{place}: no progress for 6 s while waiting for (collective|the "
                     rf"training step|an evaluation step)", output), output[-3000:]
    assert "Most recent call first" in output or "File \"" in output  # faulthandler's stacks
