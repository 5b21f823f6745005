"""Mixture-of-Experts command lines that cannot run are refused while the flags are checked
(`megatron.arguments.parse_args`, no process started), each problem naming the flag to change,
or the model config file for a field set there; and the entry point itself exits with one
message before any process group (as `python pretrain_t5.py`, and under torchrun with two ranks,
where rank 0 speaks for both)."""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import pytest
import torch.distributed as dist

from megatron.arguments import ArgumentsError, parse_args
from train_workers import base_argv

REPO = Path(__file__).resolve().parents[2]
REFUSED = "the command line cannot run"
MOE = ("--num-experts", "4")


@dataclass
class Case:
    """base_argv(data) plus `extra` under `env`; `model` (fields over the tiny model config) is
    written to <model> and passed as --model-config. Each entry of `expect`: substrings that one
    problem must all contain, one problem per entry."""

    extra: Sequence[str] = ()
    env: Dict[str, str] = field(default_factory=dict)
    model: Optional[Dict[str, object]] = None
    expect: Sequence[Tuple[str, ...]] = ()


CASES = {
    "expert_parallel_not_dividing_data_parallel": Case(
        extra=[*MOE, "--expert-model-parallel-size", "4"], env={"WORLD_SIZE": "2"},
        expect=[("--expert-model-parallel-size 4", "does not divide the data-parallel size 2")]),
    "expert_parallel_not_dividing_data_parallel_beside_tensor_parallel": Case(
        extra=[*MOE, "--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2"],
        env={"WORLD_SIZE": "4"},
        expect=[("--expert-model-parallel-size 4", "data-parallel size 2", "tensor 2")]),
    "experts_not_divisible_by_expert_parallel": Case(
        extra=["--num-experts", "3", "--expert-model-parallel-size", "2"],
        env={"WORLD_SIZE": "2"},
        expect=[("--num-experts 3", "not divisible", "--expert-model-parallel-size 2")]),
    "topk_above_the_experts": Case(
        extra=[*MOE, "--moe-router-topk", "5"],
        expect=[("--moe-router-topk", "router_topk (5)", "num_experts (4)")]),
    "topk_above_the_experts_in_the_model_config": Case(
        model={"num_experts": 4, "router_type": "topk", "router_topk": 5},
        expect=[("--model-config", "<model>", "router_topk (5)", "num_experts (4)")]),
    "cpm2_expert_parallel_not_the_data_parallel_size": Case(
        extra=["--num-experts", "2", "--moe-router-type", "cpm2"], env={"WORLD_SIZE": "2"},
        expect=[("--moe-router-type cpm2", "--expert-model-parallel-size (1) must equal the "
                 "data-parallel size (2)")]),
    "cpm2_tokens_not_in_equal_parts": Case(
        extra=[*MOE, "--moe-router-type", "cpm2", "--expert-model-parallel-size", "2",
               "--decoder-seq-length", "15"], env={"WORLD_SIZE": "2"},
        expect=[("--moe-router-type cpm2", "--micro-batch-size 2 x --decoder-seq-length 15 = 30",
                 "multiple of experts x experts per rank = 4 x 2 = 8")]),
    "capacity_factor_with_cpm2": Case(
        extra=["--num-experts", "2", "--moe-router-type", "cpm2",
               "--moe-expert-capacity-factor", "1.0"],
        expect=[("--moe-expert-capacity-factor", "router_type 'cpm2'")]),
    "capacity_factor_with_base": Case(
        extra=[*MOE, "--moe-router-type", "base", "--moe-expert-capacity-factor", "1.0"],
        expect=[("--moe-expert-capacity-factor", "router_type 'base'")]),
    "eval_capacity_factor_with_base": Case(
        extra=[*MOE, "--moe-router-type", "base", "--moe-eval-capacity-factor", "2.0"],
        expect=[("--moe-eval-capacity-factor", "router_type 'base'")]),
    "expert_bias_with_base": Case(
        extra=[*MOE, "--moe-router-type", "base", "--moe-router-enable-expert-bias"],
        expect=[("--moe-router-enable-expert-bias", "router_type 'base'")]),
    "zero_3": Case(
        extra=[*MOE, "--zero-stage", "3"],
        expect=[("--zero-stage 3", "Mixture-of-Experts", "--zero-stage 1 or 2")]),
    "zero_3_with_experts_from_the_model_config": Case(
        extra=["--zero-stage", "3"], model={"num_experts": 4},
        expect=[("--zero-stage 3", "Mixture-of-Experts")]),
    # --bf16 with ZeRO-0 is refused for any model too (training/ds_config.py): two problems
    "zero_0_with_bf16": Case(
        extra=[*MOE, "--bf16", "--zero-stage", "0"],
        expect=[("--zero-stage 0 with bf16", "Mixture-of-Experts", "--zero-stage 1 or 2"),
                ("--bf16 with ZeRO stage 0",)]),
    "expert_parallel_on_a_dense_model": Case(
        extra=["--expert-model-parallel-size", "2"], env={"WORLD_SIZE": "2"},
        expect=[("--expert-model-parallel-size 2", "needs a Mixture-of-Experts model")]),
    "router_dtype_in_the_model_config": Case(
        model={"num_experts": 4, "router_dtype": "bfloat16"},
        expect=[("--model-config", "<model>", "router_dtype 'bfloat16'", "float32")]),
}


def command_line(case: Case, data, tmp_path):
    """(argv, {placeholder: path}) of `case`, its model config written under tmp_path."""
    paths = {"model": str(tmp_path / "model.json")}
    extra = list(case.extra)
    if case.model is not None:
        tiny = json.loads(Path(data.tiny).read_text(encoding="utf-8"))
        Path(paths["model"]).write_text(json.dumps({**tiny, **case.model}))
        extra += ["--model-config", paths["model"]]
    return base_argv(data, *extra), paths


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_naming_what_to_change(name, train_data, tmp_path):
    case = CASES[name]
    argv, paths = command_line(case, train_data, tmp_path)
    with pytest.raises(ArgumentsError) as info:
        parse_args(argv, env=case.env)
    assert not dist.is_initialized()
    problems = info.value.problems
    for together in case.expect:
        wanted = [w.replace("<model>", paths["model"]) for w in together]
        assert any(all(w in p for w in wanted) for p in problems), (wanted, problems)
    assert len(problems) == len(case.expect), problems


def test_the_same_layouts_run_when_they_fit(train_data):
    """The refused cases less their fault: the flags reach the run's configuration."""
    config = parse_args(base_argv(train_data, *MOE, "--moe-router-topk", "2",
                                  "--expert-model-parallel-size", "2",
                                  "--moe-expert-capacity-factor", "1.25"),
                        env={"WORLD_SIZE": "2"})
    t5 = config.model.t5
    assert (t5.num_experts, t5.router_type, t5.router_topk, t5.expert_capacity_factor) == \
        (4, "topk", 2, 1.25)
    assert (config.parallel.data_parallel_size, config.parallel.expert_model_parallel_size) == \
        (2, 2)
    config = parse_args(base_argv(train_data, *MOE, "--moe-router-type", "base", "--bf16",
                                  "--zero-stage", "1"), env={})
    assert config.model.t5.router_type == "base" and config.zero.stage == 1
    assert not dist.is_initialized()


def clean_env() -> Dict[str, str]:
    """This environment without a launcher's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "SLURM_",
                                "GROUP_RANK", "NODE_RANK"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def assert_refused_once(proc, *names):
    """Exit status 2, one message naming `names`, no traceback, DeepSpeed never started."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert proc.stderr.count(REFUSED) == 1, output[-3000:]
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1, output[-3000:]
    assert all(name in problems[0] for name in names), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "built successfully" not in output, output[-3000:]


def test_the_entry_point_refuses_zero_3_with_experts_once(train_data, tmp_path):
    save = tmp_path / "save"
    argv = base_argv(train_data, *MOE, "--zero-stage", "3", "--save", str(save))
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_t5.py"), *argv], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert_refused_once(proc, "--zero-stage 3", "Mixture-of-Experts")
    assert proc.stderr.startswith(f"error: {REFUSED}:\n"), proc.stderr[-3000:]
    assert not save.exists()


@pytest.mark.slow
def test_torchrun_refuses_experts_not_divisible_by_expert_parallel_once(train_data, tmp_path):
    from harness import free_port

    save = tmp_path / "save"
    argv = base_argv(train_data, "--num-experts", "3", "--expert-model-parallel-size", "2",
                     "--save", str(save))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--master_port", str(free_port()), str(REPO / "pretrain_t5.py"),
                           *argv], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert proc.stderr.count(REFUSED) == 1, output[-3000:]
    assert re.search(r"--num-experts 3 is not divisible by --expert-model-parallel-size 2",
                     proc.stderr), output[-3000:]
    assert not re.search(r"\[rank\d+\]: *Traceback", output), output[-3000:]
    assert "built successfully" not in output, output[-3000:]
    assert not save.exists()
