"""--profile: the flags are checked (exit 2, the flag named); the recorder traces exactly the
window N+1 ... M of iterations, also on a resumed run; a real run writes, on the chosen ranks
only, a Chrome trace (the file name and JSON of torch's tensorboard_trace_handler) that holds
one ProfilerStep#<iteration> per profiled step and the named ranges of the step, the loop and
the pipeline schedule, as many as the steps in the window ran; a run's timing listeners are its
own."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness import run_workers
from megatron.arguments import ArgumentsError, parse_args
from megatron.pretrain_t5 import main
from megatron.config.training import ProfileConfig
from megatron.training.profiling import StepProfiler
from train_workers import base_argv, run_pretrain, run_timed_then_not

# What torch.profiler.tensorboard_trace_handler names a file, and what TensorBoard's profiler
# plugin looks for: <worker>.<time in ns>.pt.trace.json
TRACE_NAME = re.compile(r"^rank(\d+)\.\d+\.pt\.trace\.json$")


def problems(argv, world_size=1):
    with pytest.raises(ArgumentsError) as e:
        parse_args(argv, env={"WORLD_SIZE": str(world_size)})
    return e.value.problems


def test_bad_profile_flags_are_named(train_data, tmp_path):
    save = ["--save", str(tmp_path / "ckpt")]
    assert problems(base_argv(train_data, "--profile", "--profile-step-start", "1",
                              "--profile-step-end", "2")) == [
        "--profile writes its traces into SAVE/profile/: give a local --save"]
    assert problems(base_argv(train_data, "--profile", *save, "--profile-step-end", "3")) == [
        "--profile-step-start 10 (the default) must be less than --profile-step-end 3 (the "
        "trace holds iterations start+1 ... end)"]
    assert problems(base_argv(train_data, "--profile-step-start", "1", "--profile-ranks",
                              "0")) == ["--profile-step-start has effect only with --profile",
                                        "--profile-ranks has effect only with --profile"]
    assert problems(base_argv(train_data, "--profile", *save, "--profile-step-start", "3",
                              "--profile-step-end", "3")) == [
        "--profile-step-start 3 must be less than --profile-step-end 3 (the trace holds "
        "iterations start+1 ... end)"]
    assert problems(base_argv(train_data, "--profile", *save, "--profile-step-start", "-1",
                              "--profile-step-end", "2")) == [
        "--profile-step-start -1 must be 0 or more"]
    # the default window (10 to 12) does not fit a 4-step run
    assert problems(base_argv(train_data, "--profile", *save)) == [
        "--profile-step-end 12 (the default) is past the run's last iteration (--train-iters "
        "4)"]
    # --train-samples 12 is 3 steps of 4 samples
    argv = base_argv(train_data, "--profile", *save, "--profile-step-start", "1",
                     "--profile-step-end", "4")
    argv[argv.index("--train-iters"):argv.index("--train-iters") + 2] = ["--train-samples", "12"]
    assert problems(argv) == [
        "--profile-step-end 4 is past the run's last iteration (--train-iters 3)"]
    assert problems(base_argv(train_data, "--profile", *save, "--profile-step-start", "1",
                              "--profile-step-end", "2", "--profile-ranks", "1", "2"),
                    world_size=2) == [
        "--profile-ranks 2 is not a rank of this job of 2 processes (0 ... 1)"]
    assert main(base_argv(train_data, "--profile", "--profile-step-end", "2")) == 2


def test_good_profile_flags(train_data, tmp_path):
    config = parse_args(base_argv(train_data, "--save", str(tmp_path / "ckpt"), "--profile",
                                  "--profile-step-start", "0", "--profile-step-end", "4",
                                  "--profile-ranks", "1", "0", "1"),
                        env={"WORLD_SIZE": "2"})
    assert config.profile == ProfileConfig(True, 0, 4, (0, 1), str(tmp_path / "ckpt" /
                                                                   "profile"))
    assert parse_args(base_argv(train_data), env={}).profile == ProfileConfig()


def trace(path: Path):
    """(the JSON, Counter of event names)"""
    data = json.loads(path.read_text())
    return data, Counter(e.get("name") for e in data["traceEvents"])


def steps(names):
    return sorted(int(n.split("#")[1]) for n in names if n and n.startswith("ProfilerStep#"))


def run_boundaries(profiler, first, last):
    """What the loop does from iteration `first` to `last`: a boundary, one 'forward'."""
    for iteration in range(first, last):
        profiler.boundary(iteration)
        with profiler.ranges("forward"):
            torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.finish()


def test_the_window_is_iterations_start_plus_one_to_end(tmp_path):
    lines = []
    fresh = StepProfiler(ProfileConfig(True, 1, 3, (0,), str(tmp_path)), 0, log=lines.append)
    run_boundaries(fresh, 0, 5)
    data, names = trace(fresh.path)
    assert steps(names) == [2, 3]
    assert names["forward"] == 2
    assert TRACE_NAME.match(fresh.path.name)
    assert lines == [f"profile: rank 0 iterations 2-3 written to {fresh.path}"]
    # resumed at iteration 2 inside the window 1..4: iterations 3 and 4
    resumed = StepProfiler(ProfileConfig(True, 1, 4, (0,), str(tmp_path / "r")), 0,
                           log=lines.append)
    run_boundaries(resumed, 2, 6)
    assert steps(trace(resumed.path)[1]) == [3, 4]
    # stopped early (an exit condition) at iteration 3 of the window 1..5: what ran
    early = StepProfiler(ProfileConfig(True, 1, 5, (0,), str(tmp_path / "e")), 0,
                         log=lines.append)
    run_boundaries(early, 0, 3)
    assert steps(trace(early.path)[1]) == [2, 3]
    # resumed past the window, or not a chosen rank: no trace
    past = StepProfiler(ProfileConfig(True, 1, 3, (0,), str(tmp_path / "p")), 0,
                        log=lines.append)
    run_boundaries(past, 3, 5)
    assert past.path is None and not (tmp_path / "p").exists()
    assert lines[-1] == "profile: the run starts at iteration 3, past --profile-step-end 3: " \
                        "no trace on rank 0"
    other = StepProfiler(ProfileConfig(True, 1, 3, (0,), str(tmp_path / "o")), 1)
    run_boundaries(other, 0, 5)
    assert other.path is None and not (tmp_path / "o").exists()


def traces(folder: Path):
    """{rank: path} of the trace files in folder."""
    out = {}
    for path in folder.iterdir():
        match = TRACE_NAME.match(path.name)
        assert match, path.name
        out[int(match.group(1))] = path
    return out


@pytest.mark.slow
def test_a_profiled_run_traces_its_window(train_data, tmp_path):
    """One process, 4 steps of 2 micro-batches, the window 1..3 (steps 2 and 3): a save and an
    evaluation at iteration 2 fall inside it, as does the log boundary's loss all-reduce."""
    ckpt = tmp_path / "ckpt"
    argv = base_argv(train_data, "--save", str(ckpt), "--save-interval", "2", "--profile",
                     "--profile-step-start", "1", "--profile-step-end", "3")
    plain = run_workers(1, run_pretrain, [base_argv(train_data)], timeout=600)[0][0]
    profiled = run_workers(1, run_pretrain, [argv], timeout=600)[0][0]
    assert profiled["losses"] == pytest.approx(plain["losses"], rel=1e-6)  # changes nothing
    files = traces(ckpt / "profile")
    assert list(files) == [0]
    data, names = trace(files[0])
    assert steps(names) == [2, 3]
    micro = 2  # accumulation steps per optimizer step
    assert names["forward"] == names["backward"] == names["data-wait"] == 2 * micro
    # DeepSpeed calls allreduce_gradients after each backward (it reduces at the boundary)
    assert names["comm:grad-reduce"] == 2 * micro
    assert names["optimizer-step"] == names["comm:stop-all-reduce"] == 2
    assert names["comm:loss-all-reduce"] == names["checkpoint-save"] == \
        names["evaluation"] == 1  # at iteration 2
    assert data["distributedInfo"]["rank"] == 0
    # every range lies inside a step's span
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in data["traceEvents"]
             if e.get("name", "").startswith("ProfilerStep#")]
    for e in data["traceEvents"]:
        if e.get("name") in ("forward", "checkpoint-save", "comm:stop-all-reduce"):
            assert any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans), e


@pytest.mark.slow
def test_a_runs_timing_listener_is_its_own(train_data):
    """A listener handed to a run is attached to its step and told every range of its 4 steps
    of 2 micro-batches; a later run of the process, handed none, tells it nothing."""
    argv = base_argv(train_data)
    timed, after = run_workers(1, run_timed_then_not, [argv, argv], timeout=600)[0]
    micro = 2
    assert timed["attached"] == 1
    assert timed["closed"]["forward"] == timed["closed"]["backward"] == 4 * micro
    assert timed["closed"]["optimizer-step"] == 4
    assert after == timed


@pytest.mark.slow
def test_a_pipeline_run_traces_the_chosen_rank_only(train_data, tmp_path):
    """PP=2 on 2 processes, --profile-ranks 1 (the last stage): its trace alone, with the
    schedule's instructions as ranges inside pipeline-train-batch."""
    ckpt = tmp_path / "ckpt"
    argv = base_argv(train_data, "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                     "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                     "--profile-ranks", "1")
    run_workers(2, run_pretrain, [argv], timeout=600)
    files = traces(ckpt / "profile")
    assert list(files) == [1]
    data, names = trace(files[1])
    assert data["distributedInfo"]["rank"] == 1
    assert steps(names) == [3, 4]
    micro = 2
    assert names["pipeline-train-batch"] == names["comm:pipeline-sums"] == 2
    assert names["forward"] == names["backward"] == names["comm:recv-activations"] == \
        names["comm:send-grads"] == names["pipeline:load-micro-batch"] == 2 * micro
    assert names["data-wait"] == 2 * micro  # the last stage reads the labels
    assert names["optimizer-step"] == names["comm:grad-reduce"] == \
        names["comm:tied-grad-reduce"] == 2
    assert names["comm:send-activations"] == names["comm:recv-grads"] == 0  # first stage's
    assert names["comm:stop-all-reduce"] == 2 and names["checkpoint-save"] == 1  # the last
