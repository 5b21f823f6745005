"""`python -m megatron.evaluate`: lm-evaluation-harness tasks on one of our checkpoints.

    python -m megatron.evaluate --load ckpt/ --tokenizer-model spm/t5.model \
        --tasks copa_local,my_gen [--include-path tasks/] [--num-fewshot 5] [--limit 100] \
        [--batch-size 16] [--log-samples] --output-path results/
    torchrun --nproc-per-node 4 -m megatron.evaluate ... --tensor-model-parallel-size 2
    torchrun --nproc-per-node 4 -m megatron.evaluate ... --pipeline-model-parallel-size 2
    torchrun --nproc-per-node 4 -m megatron.evaluate ... --expert-model-parallel-size 4

The harness's own evaluator (`lm_eval.simple_evaluate`) runs the tasks on our model through
megatron/evaluation/harness_lm.py's MegatronT5LM, so tasks, few-shot contexts, filters, metrics
and the files under --output-path (results_*.json, with --log-samples samples_*.jsonl) are the
harness's own; the flags are its flags' names, with dashes (its underscored spellings work
too). The model is read as `python -m megatron.generate` reads it (megatron/loaded_model.py): any
saved layout, run at TP x PP x DP (x EP for Mixture-of-Experts), a prompt-tuning run's prompt
with --prompt-load, --load on s3://. The data-parallel ranks split the documents; rank 0 prints
the harness's table and writes the files. Install: `pip install -e ".[eval]"`.

Every problem found before the model runs (the flags, unknown tasks, --load, the tokenizer) is
listed at once, one line each, exit 2; a failure while running, exit 1; Ctrl-C or SIGTERM, exit
130 (docs/troubleshooting.md, "Exit statuses").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from megatron.cli import CommandLineParser
from megatron.loaded_model import (ModelError, ModelFailure, add_model_flags, build_model,
                                   model_flag_problems, model_processes, prepare_model,
                                   run_command)


def _both(group, name: str, **kwargs) -> None:
    """A harness flag under its name with dashes and with underscores (lm_eval's spelling)."""
    dashed = "--" + name
    spelled = [dashed] + (["--" + name.replace("-", "_")] if "-" in name else [])
    group.add_argument(*spelled, dest=name.replace("-", "_"), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="python -m megatron.evaluate", job=True,
                          description="Run lm-evaluation-harness tasks on one of our "
                                      "checkpoints.")
    h = p.add_argument_group("the harness's flags (lm_eval's names; dashes or underscores)")
    _both(h, "tasks", metavar="T1,T2", help="the tasks (or groups), comma-separated "
                                              "(required)")
    _both(h, "include-path", metavar="DIR", default=None,
          help="a folder of task YAMLs beside the harness's own")
    _both(h, "num-fewshot", type=int, default=None, metavar="K",
          help="examples in each context (default: each task's)")
    _both(h, "limit", type=float, default=None, metavar="N",
          help="documents per task (a fraction below 1: that share of them)")
    _both(h, "batch-size", type=int, default=8, metavar="B",
          help="requests run together (sorted by length, as the hf backend batches them)")
    _both(h, "log-samples", action="store_true",
          help="write each document's requests, answers and metrics (needs --output-path)")
    _both(h, "output-path", metavar="DIR", default=None,
          help="where the results JSON (and the samples) are written")
    _both(h, "gen-kwargs", metavar="K=V,...", default=None,
          help="generation arguments for every generate_until task (e.g. "
               "do_sample=false,max_gen_toks=64)")
    _both(h, "bootstrap-iters", type=int, default=100000,
          help="bootstrap resamples of each metric's standard error (0: none)")
    _both(h, "seed", default="0,1234,1234,1234", metavar="R,N,T,F",
          help="the seeds of python's random, numpy, torch and the few-shot sampler "
               "(one number: all four)")
    io = p.add_argument_group("the model")
    add_model_flags(p, io)
    io.add_argument("--max-length", type=int, default=None,
                    help="the most context tokens read (default: 2048, the harness's hf "
                         "backend's for a T5 model)")
    io.add_argument("--max-gen-toks", type=int, default=None,
                    help="new tokens of a generation whose task names no max_gen_toks "
                         "(default: 256, the hf backend's)")
    return p


def flag_problems(args, world_size: int) -> List[str]:
    """Every problem of the flags alone, all at once."""
    out = [] if args.tasks else ["--tasks is required"]
    if args.batch_size < 1:
        out.append(f"--batch-size must be at least 1, not {args.batch_size}")
    for name in ("max_length", "max_gen_toks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            out.append(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    if args.limit is not None and args.limit <= 0:
        out.append(f"--limit must be positive, not {args.limit:g}")
    if args.log_samples and not args.output_path:
        out.append("--log-samples needs --output-path (where the samples are written)")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        out.append(f"--include-path {args.include_path}: no such folder")
    if args.output_path is not None and Path(args.output_path).exists() \
            and not Path(args.output_path).is_dir() \
            and not args.output_path.endswith(".json"):
        out.append(f"--output-path {args.output_path}: a file, not a folder")
    if _seeds(args.seed) is None:
        out.append(f"--seed {args.seed}: one integer or four, comma-separated")
    out += _gen_kwargs_problems(args.gen_kwargs)
    return out + model_flag_problems(args, world_size)


def _seeds(text: str) -> Optional[List[int]]:
    try:
        seeds = [int(s) for s in str(text).split(",")]
    except ValueError:
        return None
    return seeds * 4 if len(seeds) == 1 else seeds if len(seeds) == 4 else None


def _gen_kwargs_problems(text: Optional[str]) -> List[str]:
    if not text:
        return []
    from lm_eval.utils import simple_parse_args_string

    try:
        simple_parse_args_string(text)
    except (ValueError, TypeError) as e:
        return [f"--gen-kwargs {text}: not K=V,... ({e})"]
    return []


def task_problems(args, task_manager) -> List[str]:
    """The task names the harness does not know (with --include-path's)."""
    names = _task_names(args)
    known = set(task_manager.all_tasks)
    unknown = [t for t in names if t not in known and not task_manager.match_tasks([t])]
    if not unknown:
        return []
    where = f" or in --include-path {args.include_path}" if args.include_path else \
        " (a task of your own: --include-path DIR)"
    return [f"--tasks: {', '.join(unknown)}: no such task in lm_eval {_harness_version()}"
            f"{where}; `lm_eval ls tasks` lists them"]


def _task_names(args) -> List[str]:
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def _harness_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _limit(value: Optional[float]):
    """The harness's --limit: a count, or a share below 1."""
    if value is None or value < 1:
        return value
    return int(value)


def run(args) -> int:
    from megatron.checkpoint.io.remote_tools import Staged

    with Staged() as staged:  # s3:// checkpoints' downloads, removed at the end
        return _evaluate(args, staged)


def _evaluate(args, staged) -> int:
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from megatron.initialize import distributed_env

    world_size = int(distributed_env(os.environ)["WORLD_SIZE"])  # torchrun's, or Slurm's
    problems = flag_problems(args, world_size)
    task_manager = None
    if args.tasks and not any("--include-path" in p for p in problems):
        task_manager = TaskManager(include_path=args.include_path)
        problems += task_problems(args, task_manager)
    seeds = _seeds(args.seed)
    with _harness_lm(args, world_size, problems, staged) as (lm, processes):
        # the harness's writer, into a folder beside the output that `_report` moves in
        staging = _staging(args.output_path, processes.rank)
        tracker = None
        if staging is not None:  # (a results file's name kept: the harness's <stem>_<time>)
            named = Path(args.output_path).suffix == ".json"
            tracker = EvaluationTracker(output_path=str(
                staging / Path(args.output_path).name if named else staging))
        results = lm_eval.simple_evaluate(
            model=lm, model_args={"pretrained": str(args.load)},
            tasks=_task_names(args),
            num_fewshot=args.num_fewshot, batch_size=args.batch_size, limit=_limit(args.limit),
            log_samples=args.log_samples, evaluation_tracker=tracker, gen_kwargs=args.gen_kwargs,
            task_manager=task_manager, bootstrap_iters=args.bootstrap_iters,
            random_seed=seeds[0], numpy_random_seed=seeds[1], torch_random_seed=seeds[2],
            fewshot_random_seed=seeds[3])
        if processes.rank == 0 and results is not None:
            _report(args, results, tracker, staging)
    return 0


def _staging(output_path: Optional[str], rank: int) -> Optional[Path]:
    """Where rank 0 has the harness write its files (None: nowhere): a hidden folder beside
    --output-path's files, moved into it once whole (`_publish`). A --output-path ending in
    .json is a results file's name: the harness writes beside it."""
    if output_path is None or rank != 0:
        return None
    folder = Path(output_path)
    if folder.suffix == ".json":
        folder = folder.parent
    return folder / f".evaluate-{os.getpid()}.tmp"


def _report(args, results: dict, tracker, staging: Optional[Path]) -> None:
    """The harness's table on stdout and, with --output-path, its files (as `lm_eval` writes
    them: results_<time>.json and with --log-samples samples_<task>_<time>.jsonl, in a folder
    named after --load)."""
    import shutil

    from lm_eval.utils import make_table

    samples = results.pop("samples", None)
    if tracker is not None:
        try:
            tracker.save_results_aggregated(results=results, samples=samples)
            if args.log_samples:
                for task_name in results["configs"]:
                    tracker.save_results_samples(task_name=task_name,
                                                 samples=samples[task_name])
            _publish(staging)
        except OSError as e:
            raise ModelFailure(f"--output-path {args.output_path}: cannot write "
                               f"({e.strerror})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    print(f"megatron ({args.load}), limit: {args.limit}, num_fewshot: {args.num_fewshot}, "
          f"batch_size: {args.batch_size}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if tracker is not None:
        print(f"wrote the results under {args.output_path}", file=sys.stderr)


@contextlib.contextmanager
def _harness_lm(args, world_size: int, problems: List[str], staged):
    """(MegatronT5LM, this process's ModelProcesses) for the block: the model of the flags
    (after the command's own `problems`: loaded_model.prepare_model) built at their layout in
    the process groups of `model_processes`, which end after the block."""
    from megatron import parallel_state
    from megatron.evaluation.harness_lm import DEFAULT_MAX_GEN_TOKS, DEFAULT_MAX_LENGTH, \
        MegatronT5LM

    (folder, meta, config), cut, prompt, tokenizer = prepare_model(args, problems, staged)
    with model_processes(args, world_size) as processes:
        model = build_model(folder, meta, config, processes.tp, processes.device,
                            processes.dtype, args.attention_backend, processes.ep, prompt, cut)
        data_parallel = processes.data[1] > 1
        yield MegatronT5LM(
            model, tokenizer, batch_size=args.batch_size,
            max_length=args.max_length or DEFAULT_MAX_LENGTH,
            max_gen_toks=args.max_gen_toks or DEFAULT_MAX_GEN_TOKS, device=processes.device,
            data_group=parallel_state.get_data_parallel_group() if data_parallel else None,
            expert_group=processes.ep.group if processes.ep.size > 1 else None,
            seed=_seeds(args.seed)[2]), processes


def load_lm(load: str, tokenizer_model: Optional[str] = None, **options):
    """A MegatronT5LM over the checkpoint `load` in this process (one rank: TP = PP = 1), for
    `lm_eval.simple_evaluate(model=load_lm(...))`. `options`: this command's flags by their
    names with underscores (batch_size, max_length, max_gen_toks, dtype, attention_backend,
    prompt_load, iteration, ...).

    Raises:
        ModelError: the problems of the flags or of what they name, listed.
    """
    from megatron.checkpoint.io.remote_tools import Staged

    argv = ["--load", str(load), "--tasks", "-"]
    if tokenizer_model is not None:
        argv += ["--tokenizer-model", str(tokenizer_model)]
    args = build_parser().parse_args(argv)
    for name, value in options.items():
        if not hasattr(args, name):
            raise ModelError(f"load_lm: no option {name!r} (the flags of "
                             f"`python -m megatron.evaluate`, with underscores)")
        setattr(args, name, value)
    with Staged() as staged, _harness_lm(args, 1, flag_problems(args, 1), staged) as (lm, _):
        return lm  # (one process: no group to end; the download is read into the model)


def _publish(staging: Path) -> None:
    """Move each file the harness wrote under `staging` to the same place in its parent,
    results last (a reader that finds the results finds the samples)."""
    files = sorted((p for p in staging.rglob("*") if p.is_file()),
                   key=lambda p: p.name.startswith("results_"))
    for path in files:
        target = staging.parent / path.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 evaluated, 2 refused before the model runs, 1 failed while running, 130
    interrupted; the rank that speaks for the job says why, one line a problem
    (loaded_model.run_command)."""
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args), "interrupted; no results were written")


if __name__ == "__main__":
    sys.exit(main())
