"""Command lines that cannot run are refused by `parse_args` with every problem listed at once,
each naming the flags (and the file and JSON key) involved, before any process group exists;
command lines whose flags and files agree resolve to the values both sides state."""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import pytest
import torch
import torch.distributed as dist

from megatron.arguments import ArgumentsError, parse_args
from megatron.pretrain_t5 import main
from megatron.config.training import DivergenceConfig
from train_workers import base_argv

ON_CPU = not torch.cuda.is_available()
COPY_TOKENIZER = object()
"""A `files` value: put a copy of the session's tokenizer at that name."""


@dataclass
class Case:
    """A bad command line: base_argv(data) less `drop`, plus `extra` (argparse keeps the last
    value of a repeated flag), run under `env`.

    `model` (overrides of the tiny model config) is written to <model> and passed as
    --model-config; `ds` (a dict, or text written as is) is written to <ds> and passed as
    --deepspeed_config; `files` are written under <tmp> (a name ending in / is a folder).
    Each entry of `expect` is a tuple of substrings that one problem must all contain; there must
    be exactly one problem per entry. <tmp>, <ds>, <model> and <spm> are replaced by their paths.
    """

    extra: Sequence[str] = ()
    drop: Sequence[str] = ()
    env: Dict[str, str] = field(default_factory=dict)
    model: Optional[Dict[str, object]] = None
    ds: Optional[Union[Dict[str, object], str]] = None
    files: Dict[str, object] = field(default_factory=dict)
    expect: Sequence[Tuple[str, ...]] = ()
    cpu_only: bool = False


CASES = {
    # Model parallelism.
    "heads_not_divisible_by_tp": Case(
        extra=["--tensor-model-parallel-size", "2"], env={"WORLD_SIZE": "2"},
        model={"num_heads": 3},
        expect=[("--tensor-model-parallel-size 2", "num_heads (3)")]),
    "d_ff_not_divisible_by_tp": Case(
        extra=["--tensor-model-parallel-size", "4"], env={"WORLD_SIZE": "4"},
        model={"d_ff": 66},
        expect=[("--tensor-model-parallel-size 4", "d_ff (66)")]),
    "world_size_not_divisible_by_tp_x_pp": Case(
        extra=["--tensor-model-parallel-size", "2"], env={"WORLD_SIZE": "3"},
        expect=[("world size 3", "--tensor-model-parallel-size 2",
                 "--pipeline-model-parallel-size 1")]),
    "slurm_world_size_not_divisible_by_tp": Case(
        extra=["--model-parallel-size", "4"], env={"SLURM_NTASKS": "6"},
        expect=[("world size 6", "--tensor-model-parallel-size 4")]),
    # Pipeline parallelism: refused before any process group.
    "more_stages_than_blocks": Case(
        extra=["--pipeline-model-parallel-size", "8"], env={"WORLD_SIZE": "8"},
        expect=[("--pipeline-model-parallel-size 8", "4 blocks", "every stage needs a block")]),
    "split_rank_out_of_range": Case(
        extra=["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank",
               "2"], env={"WORLD_SIZE": "2"},
        expect=[("--pipeline-model-parallel-split-rank 2", "out of range", "1 .. 1")]),
    "split_rank_without_pipeline": Case(
        extra=["--pipeline-model-parallel-split-rank", "1"],
        expect=[("--pipeline-model-parallel-split-rank 1", "--pipeline-model-parallel-size > 1")]),
    "split_rank_leaves_the_encoder_too_few_blocks": Case(
        extra=["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank",
               "3"], env={"WORLD_SIZE": "4"},
        expect=[("--pipeline-model-parallel-split-rank 3", "encoder has 2 blocks")]),
    "zero_3_with_pipeline": Case(
        extra=["--pipeline-model-parallel-size", "2", "--zero-stage", "3"],
        env={"WORLD_SIZE": "2"},
        expect=[("--pipeline-model-parallel-size 2", "--zero-stage 3", "stages 0 and 1")]),
    "zero_2_from_the_json_with_pipeline": Case(
        extra=["--pipeline-model-parallel-size", "2", "--deepspeed_config", "<ds>"],
        env={"WORLD_SIZE": "2"}, ds={"zero_optimization": {"stage": 2}},
        expect=[("--pipeline-model-parallel-size 2", "--zero-stage 2",
                 "zero_optimization.stage")]),
    "param_offload_with_pipeline": Case(
        extra=["--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--offload-param",
               "cpu"], env={"WORLD_SIZE": "2"},
        expect=[("--pipeline-model-parallel-size 2", "--zero-stage 3"),
                ("--pipeline-model-parallel-size 2", "--offload-param cpu")]),
    "partitioned_pipe_transfers": Case(
        extra=["--pipeline-model-parallel-size", "2", "--deepspeed_config", "<ds>"],
        env={"WORLD_SIZE": "2"}, ds={"pipeline": {"pipe_partitioned": True}},
        expect=[("pipeline.pipe_partitioned", "<ds>", "set it to false")]),
    "bf16_pipeline_accumulating_in_bf16": Case(
        extra=["--pipeline-model-parallel-size", "2", "--bf16", "--zero-stage", "1",
               "--deepspeed_config", "<ds>"],
        env={"WORLD_SIZE": "2"}, ds={"data_types": {"grad_accum_dtype": "bf16"}},
        expect=[("data_types.grad_accum_dtype 'bf16'", "<ds>", "--bf16", "fp32")]),
    # Batch sizes.
    "global_batch_not_multiple_of_micro": Case(
        extra=["--global-batch-size", "5"],
        expect=[("--global-batch-size 5", "--micro-batch-size 2", "data-parallel size 1")]),
    "global_batch_below_micro_x_dp": Case(
        env={"WORLD_SIZE": "4"},
        expect=[("--global-batch-size 4", "--micro-batch-size 2", "data-parallel size 4")]),
    # Required flags, all at once.
    "four_required_flags_missing": Case(
        drop=["--data-path", "--tokenizer-model", "--model-config", "--lr"],
        expect=[("--data-path", "required"), ("--tokenizer-model", "required"),
                ("--model-config", "required"), ("--lr ", "required")]),
    # Files.
    "data_prefix_missing": Case(
        extra=["--data-path", "<tmp>/nowhere_text_document"],
        expect=[("--data-path", "<tmp>/nowhere_text_document")]),
    "tokenizer_file_missing": Case(
        extra=["--tokenizer-model", "<tmp>/missing.model"],
        expect=[("--tokenizer-model", "<tmp>/missing.model", "no such file")]),
    "tokenizer_folder_empty": Case(
        extra=["--tokenizer-path", "<tmp>/spm"], drop=["--tokenizer-model"], files={"spm/": None},
        expect=[("--tokenizer-path", "<tmp>/spm", "found 0")]),
    "tokenizer_folder_with_two_models": Case(
        extra=["--tokenizer-path", "<tmp>/spm"], drop=["--tokenizer-model"],
        files={"spm/a.model": COPY_TOKENIZER, "spm/b.model": COPY_TOKENIZER},
        expect=[("--tokenizer-path", "<tmp>/spm", "found 2")]),
    "tokenizer_larger_than_vocab": Case(
        model={"vocab_size": 4000},
        expect=[("--tokenizer-model", "<spm>", "4100 ids", "vocab_size is 4000",
                 "--model-config", "--vocab-extra-ids")]),
    "model_config_unknown_key": Case(
        model={"num_head": 4},
        expect=[("--model-config", "<model>", "'num_head'", "did you mean 'num_heads'")]),
    "model_config_missing": Case(
        extra=["--model-config", "<tmp>/absent.json"],
        expect=[("--model-config", "<tmp>/absent.json")]),
    # The DeepSpeed JSON itself.
    "deepspeed_json_malformed": Case(
        ds='{\n  "train_micro_batch_size_per_gpu": 2,\n}\n',
        expect=[("--deepspeed_config", "<ds>", "line 3 column 1")]),
    "deepspeed_json_missing": Case(
        extra=["--deepspeed_config", "<tmp>/absent_ds.json"],
        expect=[("--deepspeed_config", "<tmp>/absent_ds.json", "cannot be read")]),
    "deepspeed_json_unknown_top_level_key": Case(
        ds={"gradient_cliping": 1.0},
        expect=[("<ds>", "unknown key 'gradient_cliping'", "did you mean 'gradient_clipping'")]),
    "deepspeed_json_unknown_zero_key": Case(
        ds={"zero_optimization": {"stage": 1, "overlap_com": True}},
        expect=[("<ds>", "DeepSpeed rejects it", "zero_optimization", "overlap_com")]),
    # Flags against the DeepSpeed JSON.
    "micro_batch_contradicts_json": Case(
        ds={"train_micro_batch_size_per_gpu": 4},
        expect=[("--micro-batch-size 2", "train_micro_batch_size_per_gpu: 4", "<ds>")]),
    "global_batch_contradicts_json": Case(
        ds={"train_batch_size": 8},
        expect=[("--global-batch-size 4", "train_batch_size: 8", "<ds>")]),
    "accumulation_contradicts_global_batch": Case(
        ds={"gradient_accumulation_steps": 4},
        expect=[("gradient_accumulation_steps: 4", "<ds>", "--global-batch-size 4",
                 "--micro-batch-size 2", "= 2")]),
    "clipping_contradicts_json": Case(
        extra=["--clip-grad", "1.0"], ds={"gradient_clipping": 0.5},
        expect=[("--clip-grad 1.0", "gradient_clipping: 0.5", "<ds>")]),
    "bf16_flag_contradicts_json": Case(
        extra=["--bf16", "--zero-stage", "1"], ds={"bf16": {"enabled": False}},
        expect=[("--bf16", "bf16.enabled: false", "<ds>")]),
    "zero_stage_contradicts_json": Case(
        extra=["--zero-stage", "2"], ds={"zero_optimization": {"stage": 1}},
        expect=[("--zero-stage 2", "zero_optimization.stage: 1", "<ds>")]),
    # Precision.
    "fp16_and_bf16": Case(
        extra=["--fp16", "--bf16", "--zero-stage", "1"],
        expect=[("--fp16", "--bf16", "exclude")]
        + ([("--fp16", "CUDA")] if ON_CPU else [])),
    "fp16_json_and_bf16_flag": Case(
        extra=["--bf16", "--zero-stage", "1"], ds={"fp16": {"enabled": True}},
        expect=[("--fp16", "--bf16", "exclude", "DeepSpeed JSON")]
        + ([("--fp16", "CUDA")] if ON_CPU else [])),
    "fp16_on_cpu": Case(
        extra=["--fp16"], cpu_only=True,
        expect=[("--fp16", "CUDA", "--bf16")]),
    "loss_scale_without_fp16": Case(
        extra=["--loss-scale", "128"],
        expect=[("--loss-scale", "only with --fp16")]),
    "bf16_with_zero_0": Case(
        extra=["--bf16"],
        expect=[("--bf16", "ZeRO stage 0", "--zero-stage")]),
    # Optimizer and schedule in the JSON.
    "optimizer_lamb": Case(
        ds={"optimizer": {"type": "Lamb", "params": {"lr": 3e-3}}},
        expect=[("optimizer.type 'Lamb'", "<ds>", "Adam")]),
    "optimizer_lr_contradicts_flag": Case(
        ds={"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
        expect=[("--lr 0.003", "optimizer.params.lr: 0.0001", "<ds>")]),
    "optimizer_beta_contradicts_flag": Case(
        extra=["--adam-beta2", "0.999"],
        ds={"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}},
        expect=[("--adam-beta2 0.999", "optimizer.params.betas[1]: 0.95", "<ds>")]),
    "scheduler_section": Case(
        ds={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
        expect=[("scheduler", "<ds>", "--lr-decay-style", "remove the section")]),
    # ZeRO offload.
    "offload_param_with_zero_2": Case(
        extra=["--offload-param", "cpu", "--zero-stage", "2"],
        expect=[("--offload-param cpu", "--zero-stage", "have 2")]),
    "offload_optimizer_nvme_without_path": Case(
        extra=["--offload-optimizer", "nvme", "--zero-stage", "3"],
        expect=[("--offload-optimizer nvme", "--nvme-path")]),
    "offload_optimizer_cpu_with_zero_0": Case(
        extra=["--offload-optimizer", "cpu"],
        expect=[("--offload-optimizer cpu", "--zero-stage", "have 0")]),
    "offload_json_with_zero_0": Case(
        ds={"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        expect=[("--offload-optimizer cpu", "have 0")]),
    "nvme_path_without_nvme_offload": Case(
        extra=["--nvme-path", "<tmp>"],
        expect=[("--nvme-path", "only with --offload-optimizer/--offload-param nvme")]),
    # Activation checkpointing.
    "partition_activations": Case(
        ds={"activation_checkpointing": {"partition_activations": True}},
        expect=[("activation_checkpointing.partition_activations", "<ds>", "not supported")]),
    "deepspeed_activation_checkpointing_without_json": Case(
        extra=["--deepspeed-activation-checkpointing"],
        expect=[("--deepspeed-activation-checkpointing", "--deepspeed_config")]),
    # Checkpoints.
    "save_interval_without_save": Case(
        extra=["--save-interval", "10"],
        expect=[("--save-interval", "--save ")]),
    "detect_nan_layers_with_a_pipeline": Case(
        extra=["--detect-nan-layers", "--pipeline-model-parallel-size", "2"],
        env={"WORLD_SIZE": "2"},
        expect=[("--detect-nan-layers", "--pipeline-model-parallel-size")]),
    "detect_nan_layers_without_the_guard": Case(
        extra=["--detect-nan-layers", "--no-check-for-nan-in-loss-and-grad"],
        expect=[("--detect-nan-layers", "--no-check-for-nan-in-loss-and-grad")]),
    "divergence_thresholds_out_of_range": Case(
        extra=["--divergence-weight-growth", "0.5", "--divergence-loss-window", "0"],
        expect=[("--divergence-weight-growth 0.5", "above 1", "0 to turn this check off"),
                ("--divergence-loss-window 0", "at least 1")]),
    "divergence_thresholds_with_the_guard_off": Case(
        extra=["--no-check-for-divergence", "--divergence-loss-spike-factor", "5"],
        expect=[("--divergence-loss-spike-factor", "no effect", "--no-check-for-divergence")]),
    "keep_last_without_save": Case(
        extra=["--keep-last", "2"],
        expect=[("--keep-last needs --save",)]),
    "keep_last_zero": Case(
        extra=["--keep-last", "0", "--save", "ckpt"],
        expect=[("--keep-last 0", "keep at least 1")]),
    "no_load_optim_without_load": Case(
        extra=["--no-load-optim"], expect=[("--no-load-optim", "--load")]),
    "finetune_without_load": Case(
        extra=["--finetune"], expect=[("--finetune", "--load")]),
    "use_new_lr_without_load": Case(
        extra=["--use-new-lr"], expect=[("--use-new-lr", "--load")]),
    "load_is_a_file": Case(
        extra=["--load", "<tmp>/ckpt"], files={"ckpt": "not a folder"},
        expect=[("--load", "<tmp>/ckpt", "is a file")]),
    "finetune_from_a_missing_folder": Case(
        extra=["--load", "<tmp>/absent", "--finetune"],
        expect=[("--load <tmp>/absent", "no such folder", "--finetune")]),
    "finetune_from_a_folder_without_checkpoint": Case(
        extra=["--load", "<tmp>/empty", "--finetune"], files={"empty/": None},
        expect=[("--load <tmp>/empty", "holds no checkpoint", "--finetune")]),
    "prompt_tune_on_a_folder_without_checkpoint": Case(
        extra=["--load", "<tmp>/empty", "--prompt-tune"], files={"empty/": None},
        expect=[("--load <tmp>/empty", "holds no checkpoint", "--prompt-tune")]),
    # Paths with a URL scheme are not local paths (--data-path, --save and --load read s3://;
    # another scheme is refused by name).
    "save_and_load_on_another_scheme": Case(
        extra=["--save", "gs://ckpt/run", "--load", "hdfs://n/run"],
        expect=[("--save gs://ckpt/run", "or s3://", "not a gs:// URL", "'gs:/ckpt/run'"),
                ("--load hdfs://n/run", "not a hdfs:// URL")]),
    "log_paths_with_a_scheme": Case(
        extra=["--tensorboard-dir", "gs://b/tb", "--log-file", "s3://b/log.txt",
               "--data-cache-path", "s3://b/cache"],
        expect=[("--tensorboard-dir gs://b/tb", "not a gs:// URL"),
                ("--log-file s3://b/log.txt",), ("--data-cache-path s3://b/cache",)]),
    # Aliases that contradict each other (argparse would keep the last silently).
    "batch_size_aliases_disagree": Case(
        extra=["--batch-size", "4"],
        expect=[("--micro-batch-size 2", "--batch-size 4", "give one of them")]),
    "tensor_parallel_aliases_disagree": Case(
        extra=["--model-parallel-size", "2", "--tensor-model-parallel-size", "1"],
        env={"WORLD_SIZE": "2"},
        expect=[("--model-parallel-size 2", "--tensor-model-parallel-size 1")]),
    "seq_length_aliases_disagree": Case(
        extra=["--seq-length", "128"],
        expect=[("--encoder-seq-length 64", "--seq-length 128")]),
    # Flags that would change nothing in this combination.
    "ul2_flags_under_span_corruption": Case(
        extra=["--ul2-denoisers", "upalm", "--ul2-s-prefix", "t5", "--max-ngram", "10",
               "--short-seq-prob", "0.1"],
        expect=[("--ul2-denoisers", "only with --t5-objective ul2", "span-corruption"),
                ("--ul2-s-prefix", "only with --t5-objective ul2"),
                ("--max-ngram", "only with --t5-objective megatron"),
                ("--short-seq-prob", "only with --t5-objective megatron")]),
    "span_noise_under_ul2": Case(
        extra=["--t5-objective", "ul2", "--ul2-denoisers", '[{"kind": "R", "mean_span": 3, '
               '"rate": 0.15, "weight": 1}]', "--mask-prob", "0.15"],
        expect=[("--mask-prob", "no effect with --t5-objective ul2", "--ul2-denoisers")]),
    "mode_token_without_mode_tokens": Case(
        extra=["--t5-objective", "ul2", "--ul2-denoisers", '[{"kind": "R", "mean_span": 3, '
               '"rate": 0.15, "weight": 1}]', "--ul2-no-mode-tokens", "--ul2-r-denoiser-token",
               "[NLU]"],
        expect=[("--ul2-r-denoiser-token", "no effect with --ul2-no-mode-tokens")]),
    "moe_flags_on_a_dense_model": Case(
        extra=["--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"],
        expect=[("--moe-router-topk", "Mixture-of-Experts", "--num-experts"),
                ("--moe-aux-loss-coeff", "Mixture-of-Experts")]),
    "topk_with_the_switch_router": Case(
        extra=["--num-experts", "2", "--moe-router-type", "switch", "--moe-router-topk", "2"],
        expect=[("--moe-router-topk 2", "only with --moe-router-type topk", "switch")]),
    "object_storage_flags_with_local_data": Case(
        extra=["--object-storage-reader", "sigv4"],
        expect=[("--object-storage-reader", "only with s3:// data")]),
    # Schedule.
    "train_iters_and_train_samples": Case(
        extra=["--train-samples", "16"],
        expect=[("--train-iters", "--train-samples", "exactly one")]),
    "neither_train_iters_nor_samples": Case(
        drop=["--train-iters"],
        expect=[("--train-iters", "--train-samples", "exactly one")]),
    "train_samples_below_one_batch": Case(
        drop=["--train-iters"], extra=["--train-samples", "3"],
        expect=[("--train-samples 3", "global batch (4)")]),
    "warmup_iters_and_fraction": Case(
        extra=["--lr-warmup-fraction", "0.1"],
        expect=[("--lr-warmup-iters", "--lr-warmup-fraction", "not both")]),
    "min_lr_above_lr": Case(
        extra=["--min-lr", "0.01"],
        expect=[("--min-lr", "0.01", "--lr", "0.003")]),
    "warmup_fraction_above_one": Case(
        drop=["--lr-warmup-iters"], extra=["--warmup", "1.5"],
        expect=[("--lr-warmup-fraction", "1.5")]),
}


def fill(text: str, paths: Dict[str, str]) -> str:
    for name, path in paths.items():
        text = text.replace(f"<{name}>", path)
    return text


def without(argv, flags):
    """argv less each flag in `flags` and the values after it."""
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in flags
        if not skipping:
            out.append(token)
    return out


def build(case: Case, data, tmp_path):
    """(argv, paths) for `case`, with its files written under tmp_path."""
    paths = {"tmp": str(tmp_path), "spm": data.spm, "ds": str(tmp_path / "ds.json"),
             "model": str(tmp_path / "model.json")}
    extra = list(case.extra)
    if case.model is not None:
        tiny = json.loads(Path(data.tiny).read_text(encoding="utf-8"))
        (tmp_path / "model.json").write_text(json.dumps({**tiny, **case.model}))
        extra += ["--model-config", "<model>"]
    if case.ds is not None:
        text = case.ds if isinstance(case.ds, str) else json.dumps(case.ds)
        (tmp_path / "ds.json").write_text(text)
        extra += ["--deepspeed_config", "<ds>"]
    for name, content in case.files.items():
        target = tmp_path / name
        if name.endswith("/"):
            target.mkdir(parents=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if content is COPY_TOKENIZER:
            shutil.copy(data.spm, target)
        else:
            target.write_text(content)
    argv = without(base_argv(data), case.drop) + [fill(a, paths) for a in extra]
    return argv, paths


def problems_of(argv, env):
    with pytest.raises(ArgumentsError) as info:
        parse_args(argv, env=env)
    assert not dist.is_initialized()
    return info.value.problems


def test_base_command_line_is_valid(train_data):
    config = parse_args(base_argv(train_data), env={})
    batch = config.batch
    assert (batch.micro_batch_size, batch.global_batch_size, batch.gradient_accumulation_steps) \
        == (2, 4, 2)
    # the divergence guard and the figures at the end are on by default; the flags line and
    # meta.json record the thresholds in force
    assert config.checkpoint.divergence == DivergenceConfig() and config.logging.plots
    assert config.flags["divergence_weight_growth"] == DivergenceConfig().weight_growth
    assert not dist.is_initialized()


def test_no_plots_without_save_is_accepted(train_data):
    """--no-plots asks for less than a run without --save does anyway: nothing to refuse."""
    config = parse_args(base_argv(train_data, "--no-plots"), env={})
    assert config.checkpoint.save is None and not config.logging.plots


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(CASES[name].cpu_only and not ON_CPU,
                                                reason="a CUDA device is present"))
    for name in sorted(CASES)])
def test_bad_config_is_refused_naming_what_to_fix(name, train_data, tmp_path):
    case = CASES[name]
    argv, paths = build(case, train_data, tmp_path)
    problems = problems_of(argv, case.env)
    for together in case.expect:
        wanted = [fill(s, paths) for s in together]
        assert any(all(w in p for w in wanted) for p in problems), (wanted, problems)
    assert len(problems) == len(case.expect), problems


def test_unrelated_problems_are_reported_together(train_data, tmp_path):
    argv = base_argv(train_data, "--tensor-model-parallel-size", "2", "--save-interval", "5",
                     "--finetune", "--loss-scale", "8", "--min-lr", "1.0",
                     "--tokenizer-model", str(tmp_path / "none.model"))
    problems = problems_of(argv, {"WORLD_SIZE": "3"})
    text = "\n".join(problems)
    for wanted in ("world size 3", "--save-interval", "--finetune", "--loss-scale",
                   "--min-lr", str(tmp_path / "none.model")):
        assert wanted in text, (wanted, problems)
    assert len(problems) >= 6


def test_main_prints_every_problem_and_returns_2(train_data, tmp_path, capsys, monkeypatch):
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    argv = without(base_argv(train_data, "--save-interval", "5", "--no-load-optim",
                             "--loss-scale", "8"), ["--lr"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the command line cannot run:\n")
    for wanted in ("--lr is required", "--save-interval needs --save", "--no-load-optim needs "
                   "--load", "--loss-scale has effect only with --fp16"):
        assert f"  - {wanted}" in err, err
    assert not dist.is_initialized()


def test_unknown_lr_decay_style_exits_2(train_data, capsys):
    assert main(base_argv(train_data, "--lr-decay-style", "exponential")) == 2
    err = capsys.readouterr().err
    assert "--lr-decay-style" in err and "exponential" in err
    assert not dist.is_initialized()


# Agreeing values pass, and one side fills what the other leaves out.

def write_json(path, value):
    path.write_text(json.dumps(value))
    return str(path)


def test_json_equal_to_flags_passes(train_data, tmp_path):
    ds = write_json(tmp_path / "ds.json", {
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 4,
        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95]}}})
    config = parse_args(base_argv(train_data, "--bf16", "--zero-stage", "1", "--clip-grad", "1",
                                  "--adam-beta2", "0.95", "--deepspeed_config", ds), env={})
    assert (config.batch.micro_batch_size, config.batch.gradient_accumulation_steps,
            config.zero.stage, config.precision.precision) == (2, 2, 1, "bf16")
    assert not dist.is_initialized()


def test_json_supplies_what_the_flags_leave_out(train_data, tmp_path):
    ds = write_json(tmp_path / "ds.json", {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.95],
                                                  "eps": 1e-6, "weight_decay": 0.1}}})
    argv = without(base_argv(train_data), ["--micro-batch-size", "--global-batch-size", "--lr"])
    config = parse_args(argv + ["--deepspeed_config", ds], env={"WORLD_SIZE": "2"})
    batch, opt = config.batch, config.optimizer
    assert (config.precision.precision, config.zero.stage) == ("bf16", 1)
    assert (batch.micro_batch_size, config.parallel.data_parallel_size,
            batch.gradient_accumulation_steps, batch.global_batch_size) == (2, 2, 2, 8)
    assert (opt.lr, opt.adam_beta1, opt.adam_beta2, opt.adam_eps, opt.weight_decay,
            opt.clip_grad) == (1e-3, 0.8, 0.95, 1e-6, 0.1, 0.5)
    assert opt.schedule.max_lr == 1e-3
    assert config.deepspeed["train_batch_size"] == 8
    assert config.deepspeed["bf16"]["enabled"] and not config.deepspeed["fp16"]["enabled"]
    assert not dist.is_initialized()


def test_tokenizer_folder_with_one_model_is_used(train_data, tmp_path):
    folder = tmp_path / "spm"
    folder.mkdir()
    shutil.copy(train_data.spm, folder / "t5.model")
    argv = without(base_argv(train_data), ["--tokenizer-model"])
    config = parse_args(argv + ["--tokenizer-path", str(folder)], env={})
    assert config.data.tokenizer_model == str(folder / "t5.model")


def test_cpm2_command_line(train_data, tmp_path):
    folder = tmp_path / "spm"
    folder.mkdir()
    shutil.copy(train_data.spm, folder / "vocab.model")
    argv = ["--data-path", train_data.prefix, "--tokenizer-path", str(folder),
            "--model-config", train_data.tiny, "--data-cache-path", train_data.cache,
            "--split", "90,5,5", "--deepspeed", "--lr", "1e-3", "--train-iters", "200",
            "--batch-size", "2", "--model-parallel-size", "1", "--warmup", "0.01",
            "--enc-seq-length", "64", "--dec-seq-length", "32"]
    config = parse_args(argv, env={})
    assert (config.batch.micro_batch_size, config.batch.global_batch_size,
            config.parallel.tensor_model_parallel_size) == (2, 2, 1)
    assert config.flags["lr_warmup_fraction"] == 0.01 \
        and config.optimizer.schedule.warmup_steps == 2
    assert (config.data.encoder_seq_length, config.data.decoder_seq_length) == (64, 32)
    assert config.data.tokenizer_model == str(folder / "vocab.model")
    assert not dist.is_initialized()


def _model_with_vocab(data, tmp_path, vocab_size):
    tiny = json.loads(Path(data.tiny).read_text(encoding="utf-8"))
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**tiny, "vocab_size": vocab_size}))
    return str(path)


def test_data_made_with_another_tokenizer_is_refused(train_data, tmp_path):
    """The data's sidecar names the session's tokenizer (4,000 pieces + 100 sentinels). A
    4,101-id tokenizer whose pieces have other ids (two swapped, one added) would read the
    data's ids as other pieces: refused, naming the sidecar and both tokenizers. An extension
    (the same 4,000 pieces first, one added: train_tokenizer.py --extend) and the same
    tokenizer with another --vocab-extra-ids read it as it was made: accepted."""
    from megatron.data.tokenizers.extend import extend_model_proto, load_model_proto

    base = load_model_proto(train_data.spm)
    extended, added = extend_model_proto(base, [("▁zzqxj", -30.0)])
    assert added == ["▁zzqxj"]
    swapped = type(extended)()
    swapped.CopyFrom(extended)
    a, b = swapped.pieces[600], swapped.pieces[601]
    a.piece, b.piece = b.piece, a.piece
    paths = {}
    for name, proto in (("extended", extended), ("other", swapped)):
        paths[name] = tmp_path / f"{name}.model"
        paths[name].write_bytes(proto.SerializeToString())
    model = _model_with_vocab(train_data, tmp_path, 4224)
    argv = base_argv(train_data, "--model-config", model, "--tokenizer-model",
                     str(paths["other"]))
    problems = problems_of(argv, {})
    assert len(problems) == 1, problems
    for wanted in (f"--data-path {train_data.prefix}", f"{train_data.prefix}.meta.json",
                   "4100 ids", f"--tokenizer-model {paths['other']}", "4101 ids",
                   "first 4000 pieces"):
        assert wanted in problems[0], (wanted, problems)
    for extra in (["--tokenizer-model", str(paths["extended"])], ["--vocab-extra-ids", "101"]):
        parse_args(base_argv(train_data, "--model-config", model, *extra), env={})


def test_megatron_objective_on_document_data_is_refused(train_data, tmp_path):
    """Megatron's T5 rows are made of sentences: on _text_document data (one sequence per
    document) each row would be one document cut short. Refused, naming the prefix; the same
    documents split into sentences are accepted."""
    from data_tools import preprocess_data

    megatron = ["--t5-objective", "megatron", "--decoder-seq-length", "32"]
    problems = problems_of(base_argv(train_data, *megatron), {})
    assert len(problems) == 1 and f"--data-path {train_data.prefix}" in problems[0] \
        and "one sequence per document" in problems[0] and "--split-sentences" in problems[0], \
        problems
    sample = Path(train_data.root) / "corpus.jsonl"
    assert preprocess_data.main(["--input", str(sample), "--output-prefix",
                                 str(tmp_path / "mix"), "--tokenizer-model", train_data.spm,
                                 "--split-sentences", "--append-eod", "--workers", "1",
                                 "--no-progress"]) == 0
    parse_args(base_argv(train_data, *megatron, "--data-path",
                         str(tmp_path / "mix_text_sentence")), env={})
