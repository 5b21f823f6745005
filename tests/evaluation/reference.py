"""The reference the evaluation tests compare against: the real `lm_eval` command line with the
harness's own Hugging Face backend (`--model hf --model_args ...,backend=seq2seq`) on a `--to hf`
export, run in a subprocess as a user runs it, its per-request responses read back from the
samples files that `--log_samples` writes.

    run = run_lm_eval(export, ["local_mc_en", "local_gen_en"], tmp_path / "hf", batch_size=4)
    run.requests["local_mc_en", 0, 1].response   # (loglikelihood, is_greedy) of doc 0, choice 1
    run.results["results"]["local_mc_en"]["acc,none"]

The command runs offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE), with its
datasets cache under the output folder, from the output folder (so nothing depends on the
working directory), and with one torch thread unless OMP_NUM_THREADS is set: on a small shared
machine torch's default threads spin against each other (a 2-core machine ran the tasks 15x
slower with 2 threads than with 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tests" / "data" / "eval_tasks"
LOCAL_TASKS = ("local_mc_en", "local_gen_en", "local_rolling", "local_lcqmc_zh")
"""The four tasks of tests/data/eval_tasks (tag `local_eval`)."""

REFERENCE_BATCH = 4
"""--batch_size of the reference runs (tests/evaluation/conftest.py); an adapter compared with
them runs at the same size (the harness's greedy generations depend on the batches:
harness_rules.generation_limit)."""
FEWSHOT = dict(num_fewshot=2, limit=4, model_args=("max_length=48",))
"""The few-shot reference run: 2 examples, the first 4 docs of each task, and a max_length
short enough that contexts are left-truncated and rolling documents span several windows."""
DEFAULT_MAX_LENGTH = 2048
"""The backend's max_length for our export: its config names no n_positions (nor
max_position_embeddings, n_ctx) and its tokenizer no model_max_length, so lm_eval's default."""
RUNS = {"reference_run": DEFAULT_MAX_LENGTH, "reference_run_fewshot": 48}
"""The reference runs' fixture names and the max_length each ran with."""

Response = Union[Tuple[float, bool], float, str]


class Request(NamedTuple):
    """One request as the harness made it and the backend's answer to it.

    arguments: the request's arguments as the harness passed them to the model:
        (context, continuation) for loglikelihood (multiple_choice's choices included: the
        continuation starts with the task's target_delimiter), (text,) for
        loglikelihood_rolling, (context, generation kwargs) for generate_until.
    response: (loglikelihood, is_greedy), the rolling loglikelihood, or the generated text
        (before the task's filters).
    """

    output_type: str
    arguments: Tuple[Any, ...]
    response: Response


class HarnessRun(NamedTuple):
    results: Dict[str, Any]  # the results JSON lm_eval wrote
    requests: Dict[Tuple[str, int, int], Request]  # (task, doc_id, request index) -> request
    samples: Dict[str, List[Dict[str, Any]]]  # task -> its samples file's records
    output_dir: Path  # the folder the files are in


def lm_eval_command(export: Path, tasks: Sequence[str], output_path: Path, *,
                    batch_size: int = 4, num_fewshot: Optional[int] = None,
                    limit: Optional[int] = None, include_path: Path = TASKS_DIR,
                    model_args: Iterable[str] = (), extra: Iterable[str] = ()) -> List[str]:
    """The command line: `lm_eval --model hf --model_args pretrained=EXPORT,backend=seq2seq,
    dtype=float32[,model_args] --device cpu --tasks ... --include_path ... --batch_size B
    --log_samples --output_path OUT [--num_fewshot K] [--limit N] [extra]`."""
    args = ",".join([f"pretrained={export}", "backend=seq2seq", "dtype=float32", *model_args])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", args,
           "--device", "cpu", "--tasks", ",".join(tasks), "--include_path", str(include_path),
           "--batch_size", str(batch_size), "--log_samples", "--output_path", str(output_path)]
    if num_fewshot is not None:
        cmd += ["--num_fewshot", str(num_fewshot)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd + list(extra)


def harness_env(output_path: Path) -> Dict[str, str]:
    """The command's environment: this one (PYTHONPATH kept), offline, a private datasets
    cache, one torch thread unless set."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(Path(output_path) / "datasets_cache"),
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_lm_eval(export: Path, tasks: Sequence[str], output_path: Path, *,
                batch_size: int = 4, num_fewshot: Optional[int] = None,
                limit: Optional[int] = None, include_path: Path = TASKS_DIR,
                model_args: Iterable[str] = (), extra: Iterable[str] = (),
                timeout: float = 600) -> HarnessRun:
    """Run the `lm_eval` command (lm_eval_command) and read its results and samples back.

    Raises:
        RuntimeError: the command failed (its exit status and the end of its output), or it
            wrote other than one results file.
    """
    output_path = Path(output_path)
    output_path.mkdir(parents=True, exist_ok=True)
    cmd = lm_eval_command(export, tasks, output_path, batch_size=batch_size,
                          num_fewshot=num_fewshot, limit=limit, include_path=include_path,
                          model_args=model_args, extra=extra)
    proc = subprocess.run(cmd, cwd=output_path, env=harness_env(output_path),
                          capture_output=True, text=True, timeout=timeout)
    (output_path / "lm_eval.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval exited {proc.returncode}: {' '.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    return read_run(output_path)


def read_run(output_path: Path) -> HarnessRun:
    """The results and samples files under output_path (one run's)."""
    found = sorted(Path(output_path).glob("*/results_*.json"))
    if len(found) != 1:
        raise RuntimeError(f"{output_path}: expected one results_*.json, found {len(found)}")
    results_file = found[0]
    results = json.loads(results_file.read_text(encoding="utf-8"))
    stamp = results_file.stem[len("results_"):]
    samples: Dict[str, List[Dict[str, Any]]] = {}
    requests: Dict[Tuple[str, int, int], Request] = {}
    for task, config in results["configs"].items():
        path = results_file.parent / f"samples_{task}_{stamp}.jsonl"
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        samples[task] = records
        output_type = config["output_type"]
        for record in records:
            for index, (args, resp) in enumerate(zip(record["arguments"].values(),
                                                     record["resps"])):
                requests[task, record["doc_id"], index] = Request(
                    output_type, tuple(args.values()), parse_response(output_type, resp))
    return HarnessRun(results, requests, samples, results_file.parent)


def parse_response(output_type: str, resp: List[Any]) -> Response:
    """A samples file's `resps` entry of one request (the harness writes each value as a
    string; a float's string is its repr, so it reads back exactly)."""
    (value,) = resp  # one repeat
    if output_type in ("loglikelihood", "multiple_choice"):
        loglikelihood, is_greedy = value
        if is_greedy not in ("True", "False"):
            raise ValueError(f"is_greedy {is_greedy!r}")
        return float(loglikelihood), is_greedy == "True"
    if output_type == "loglikelihood_rolling":
        (loglikelihood,) = value if isinstance(value, list) else (value,)
        return float(loglikelihood)
    if output_type == "generate_until":
        return value
    raise ValueError(f"unknown output_type {output_type!r}")


def response_mismatches(reference: HarnessRun, other: Dict[Tuple[str, int, int], Response],
                        loglikelihood_abs: float = 1e-4, rolling_rel: float = 1e-6
                        ) -> List[str]:
    """Where `other` (responses by (task, doc_id, request index), as HarnessRun.requests holds
    them, or `responses_of(samples)`) differs from the reference: a loglikelihood more than
    loglikelihood_abs away or another is_greedy, a rolling loglikelihood more than rolling_rel
    (relative) away, a generation not identical, a request missing on either side. One line
    each; empty when they agree."""
    out = [f"{key}: missing" for key in sorted(set(reference.requests) ^ set(other))]
    for key in sorted(set(reference.requests) & set(other)):
        req, got = reference.requests[key], other[key]
        if req.output_type == "generate_until":
            bad = got != req.response
        elif req.output_type == "loglikelihood_rolling":
            bad = abs(got - req.response) > rolling_rel * abs(req.response)
        else:
            bad = abs(got[0] - req.response[0]) > loglikelihood_abs or got[1] != req.response[1]
        if bad:
            out.append(f"{key}: {got!r}, the reference {req.response!r} ({req.arguments!r})")
    return out


def responses_of(samples: Dict[str, List[Dict[str, Any]]], configs: Dict[str, Any]
                 ) -> Dict[Tuple[str, int, int], Response]:
    """Responses by (task, doc_id, request index) from `simple_evaluate(..., log_samples=True)`'s
    "samples" and "configs" (the responses as Python values, not yet strings)."""
    out = {}
    for task, records in samples.items():
        output_type = configs[task]["output_type"]
        for record in records:
            for index, resp in enumerate(record["resps"]):
                (value,) = resp
                if output_type in ("loglikelihood", "multiple_choice"):
                    value = (float(value[0]), bool(value[1]))
                elif output_type == "loglikelihood_rolling":
                    value = float(value)
                out[task, record["doc_id"], index] = value
    return out
