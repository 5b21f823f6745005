"""Pipeline parallelism on CPU: PP=2 against DP=2 and ZeRO-3 DP=2 at equal global batch (steps/s,
peak memory per rank), and the pipeline bubble measured against (P - 1) / (m + P - 1).

    python bench/bench_pipeline.py [--steps 6] [--skip 2] [--rounds 2] [--retry-above 0.3]
                                   [--bubble-steps 5] [--bubble-rounds 2]
                                   [--bubble-micro-batch 2] [--no-four] [--work DIR]
                                   [--report-only] [--no-write]

Model, data and measurement are bench_training.py's (imported): d_model 512, 4 + 4 layers,
33.6 M parameters, encoder 256 / decoder 58 tokens, fp32, AdamW, gloo, one thread per rank; each
configuration is a real `torchrun` run of the entry point, its speed the mean of rank 0's logged
step time after the first --skip steps (the fastest of --rounds rounds; a run during which
other jobs on the host kept more than --retry-above cores busy is run once more), its memory
each rank's VmHWM.

Speed and memory, global batch 8 everywhere: DP=2 (ZeRO 0, micro batch 4 per rank; the peer of
the ratios), ZeRO-3 DP=2 (the same), PP=2 (ZeRO 0, micro batch 4, m = 2 micro-batches per step)
and, unless --no-four, PP=2 x DP=2 (micro batch 2, m = 2): 4 processes on this machine's 2
cores, oversubscribed, so its figure measures the sharing as much as the layout.

The bubble: PP=2 with micro batch --bubble-micro-batch and m = 1, 4 and 8 micro-batches per step,
two processes on two cores (one each, one thread each, so a stage that waits leaves its core
idle rather than lending it to the other). Inside each rank (this file run as a torchrun worker,
`--worker`, which then calls the entry point's main), every instruction of DeepSpeed's pipeline
schedule is timed: PipelineEngine._INSTRUCTION_MAP holds the functions that _exec_schedule
dispatches, so the timers wrap its entries, not the methods (patching the methods would not be
seen). Per stage and step:

    window = from train_batch's start to the end of ReduceTiedGrads, the first point where the
             stages meet after the last backward pass (the forward and backward passes of the m
             micro-batches, the sends and receives, the all-reduce of the tied weights' gradients;
             the data-parallel reduction, the optimizer step and the loss broadcast after it are
             left out: the formula does not model them)
    busy   = the time in ForwardPass + BackwardPass
    idle   = 1 - busy / window

The wait for the other stage shows up inside RecvActivation / RecvGrad, inside SendActivation /
SendGrad (gloo's send returns only once the peer has posted the matching receive) and, for the
stage that finishes its backward passes first, inside ReduceTiedGrads (the all-reduce of the tied
embedding waits for the other stage); idle also holds the transfers themselves and the
micro-batch loads.
The figure is the median over the timed steps, for each stage, and their mean is compared with
(P - 1) / (m + P - 1). The host is shared: the bubble runs go in --bubble-rounds rounds and the
round in which other jobs kept the fewest cores busy counts (a stage slowed by another job makes
the other wait). Also shown: the same 1F1B model with the measured per-micro-batch work
t_s of each stage instead of equal stages, step = sum_s t_s + (m - 1) max_s t_s, idle_s = 1 -
m t_s / step (equal t_s give the formula), which separates the imbalance of the cut from
what the engine adds.

Results go to bench/RESULTS.md (section "pipeline") and the figures to WORK/results.json
(--report-only rewrites the report from them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    ENC_LEN,
    WORK,
    deepspeed_version,
    gib,
    machine_line,
    markdown_table,
    model_size,
    prepare_data,
    run_torchrun,
    train_flags,
    write_section,
)

GLOBAL_BATCH = 8
PP2 = ["--pipeline-model-parallel-size", "2"]
CONFIGS = [
    # name, processes, micro batch x micro-batches x DP, flags after train_flags's
    ("DP=2, ZeRO 0", 2, "4 x 1 x 2", ["--zero-stage", "0"]),
    ("ZeRO-3 DP=2", 2, "4 x 1 x 2", ["--zero-stage", "3"]),
    ("PP=2", 2, "4 x 2 x 1", [*PP2, "--zero-stage", "0"]),
]
FOUR = ("PP=2 x DP=2 (4 processes)", 4, "2 x 2 x 2",
        [*PP2, "--zero-stage", "0", "--micro-batch-size", "2"])
MICRO_BATCHES = (1, 4, 8)
PARTS = ("ForwardPass", "BackwardPass", "LoadMicroBatch", "SendActivation", "RecvActivation",
         "SendGrad", "RecvGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
"""DeepSpeed's schedule instructions, in the order of the report's table; the last two come
after the window."""
TIMES_ENV = "BENCH_PIPELINE_TIMES"
"""The worker writes each rank's per-step instruction times to DIR/rank<R>.jsonl."""


# The worker (inside each rank) --------------------------------------------------------------
def worker(argv: Sequence[str]) -> int:
    """The entry point with a timing listener (megatron/training/timing.py) on the pipeline
    engine's schedule instructions: one JSON line per step in $BENCH_PIPELINE_TIMES/rank<R>.jsonl
    (the stage, its micro-batches, the step's wall time, the window up to the end of the tied
    gradients' reduction and each instruction's time)."""
    from megatron.pretrain_t5 import main as entry_point
    from megatron.training import timing
    from megatron.training.profiling import PIPELINE_BATCH, PIPELINE_INSTRUCTIONS

    out = Path(os.environ[TIMES_ENV]) / f"rank{os.environ['RANK']}.jsonl"
    instruction_of = {name: kind for kind, name in PIPELINE_INSTRUCTIONS.items()}
    clock = time.perf_counter

    class Instructions(timing.RangeListener):
        engine, start, window, times = None, 0.0, 0.0, {}

        def attach(self, step):
            self.engine = step.engine

        def opened(self, name):
            if name == PIPELINE_BATCH:
                self.start, self.window, self.times = clock(), 0.0, {}

        def closed(self, name, seconds, nbytes):
            if name == PIPELINE_BATCH:
                record = {"stage": self.engine.stage_id,
                          "micro_batches": self.engine.micro_batches, "wall": seconds,
                          "window": self.window, "times": self.times}
                with open(out, "a") as f:
                    f.write(json.dumps(record) + "\n")
            elif name in instruction_of:
                kind = instruction_of[name]
                self.times[kind] = self.times.get(kind, 0.0) + seconds
                if kind == "ReduceTiedGrads":
                    self.window = clock() - self.start

    return entry_point(list(argv), listeners=[Instructions()])


def read_times(folder: Path, rank: int) -> List[dict]:
    path = folder / f"rank{rank}.jsonl"
    if not path.exists():
        sys.exit(f"the worker wrote no instruction times to {path}")
    return [json.loads(line) for line in path.read_text().splitlines()]


# Runs ---------------------------------------------------------------------------------------
@dataclass
class SpeedRow:
    """One configuration's figures (bytes, seconds), as saved in WORK/results.json."""

    name: str
    processes: int
    layout: str
    speeds: List[float] = field(default_factory=list)
    others: List[float] = field(default_factory=list)
    steps: List[float] = field(default_factory=list)
    """the fastest round's timed step times."""
    hwm: Dict[int, int] = field(default_factory=dict)
    """rank -> peak resident bytes, the highest over the rounds."""

    @property
    def speed(self) -> float:
        return max(self.speeds)


@dataclass
class BubbleRow:
    micro_batches: int
    micro_batch_size: int
    idle: List[float]
    """per stage: the median over the timed steps of 1 - busy / window."""
    busy: List[float]
    """per stage: the median forward + backward time of a step, seconds."""
    window: List[float]
    """per stage: the median window, seconds."""
    parts: List[Dict[str, float]]
    """per stage: the time of each instruction kind in the step with the median window (and
    that window, "window"), seconds."""
    step_s: float
    """the median of rank 0's logged step time."""
    others: float
    """cores other jobs kept busy during the run."""
    hwm: Dict[int, int] = field(default_factory=dict)
    rounds: List[List[float]] = field(default_factory=list)
    """[stage-mean idle, others' CPU] of every round, this one's included."""
    cut: List[str] = field(default_factory=list)
    """the entry point's description of the stages (its `  stage N: ...` lines)."""

    @property
    def formula(self) -> float:
        return 1 / (self.micro_batches + 1)  # (P - 1) / (m + P - 1), P = 2

    @property
    def modelled(self) -> float:
        """The stages' mean idle in 1F1B with the measured per-micro-batch work of each."""
        m, work = self.micro_batches, [b / self.micro_batches for b in self.busy]
        step = sum(work) + (m - 1) * max(work)
        return statistics.mean(1 - m * t / step for t in work)


def timed_run(flags: Sequence[str], nproc: int, module: str, log: Path, times: Path, args):
    """One torchrun run; its timed step times (rank 0's log) and the Run."""
    times.mkdir(parents=True, exist_ok=True)
    for old in times.glob("rank*.jsonl"):
        old.unlink()
    env = {TIMES_ENV: str(times), "OMP_NUM_THREADS": "1"}
    run = run_torchrun([*(["--worker"] if module != "megatron.pretrain_t5" else []), *flags],
                       log, env, nproc=nproc, module=module)
    steps = [t for it, t in sorted(run.step_s.items()) if it > args.skip]
    if not steps:
        sys.exit(f"no timed step in {log}")
    return steps, run


def time_config(row: SpeedRow, extra: Sequence[str], paths, args, index: int, round_: int):
    """One timed run of the plain entry point, added to `row`."""
    flags = train_flags(paths, "model", args.steps,
                        [*extra, "--global-batch-size", str(GLOBAL_BATCH)])
    steps, run = timed_run(flags, row.processes, "megatron.pretrain_t5",
                           args.work / f"speed{index}_{round_}.log", args.work / "times", args)
    if len(steps) != args.steps - args.skip:
        sys.exit(f"{row.name}: expected {args.steps} logged steps, found {len(run.step_s)}")
    speed = 1 / statistics.mean(steps)
    if not row.speeds or speed > row.speed:
        row.steps = steps
    row.speeds.append(speed)
    row.others.append(run.others_cpu)
    row.hwm = {k: max(v, row.hwm.get(k, 0)) for k, v in run.hwm.items()}


def measure_bubble(m: int, paths, args, round_: int) -> BubbleRow:
    """One instrumented PP=2 run with m micro-batches per step."""
    micro = args.bubble_micro_batch
    flags = train_flags(paths, "model", args.bubble_steps,
                        [*PP2, "--zero-stage", "0", "--micro-batch-size", str(micro),
                         "--global-batch-size", str(micro * m)])
    folder, log = args.work / f"times_bubble{m}_{round_}", args.work / f"bubble{m}_{round_}.log"
    steps, run = timed_run(flags, 2, "bench.bench_pipeline", log, folder, args)
    idle, busy, window, parts = [], [], [], []
    for rank in (0, 1):
        records = read_times(folder, rank)[args.skip:]
        if not records or any(r["micro_batches"] != m or r["window"] <= 0 for r in records):
            sys.exit(f"rank {rank}: unexpected instruction times in {folder}")
        work = [r["times"]["ForwardPass"] + r["times"]["BackwardPass"] for r in records]
        idle.append(statistics.median(1 - w / r["window"] for w, r in zip(work, records)))
        busy.append(statistics.median(work))
        window.append(statistics.median(r["window"] for r in records))
        middle = sorted(records, key=lambda r: r["window"])[(len(records) - 1) // 2]
        parts.append(dict(middle["times"], window=middle["window"]))
    if read_times(folder, 0)[0]["stage"] != 0:
        sys.exit("rank 0 is not the first stage")
    cut = [line.strip() for line in log.read_text().splitlines()
           if re.match(r"  stage \d+: ", line)]
    return BubbleRow(m, micro, idle, busy, window, parts, statistics.median(steps),
                     run.others_cpu, dict(run.hwm), [], cut)


# Main ---------------------------------------------------------------------------------------
def git_commit() -> str:
    """The checkout's commit, with "+ changes" when tracked files differ; "" outside git."""
    import subprocess

    from bench.common import REPO

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True)
    if head.returncode != 0:
        return ""
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    return head.stdout.strip() + (" + changes" if dirty else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps of each speed run")
    parser.add_argument("--skip", type=int, default=2,
                        help="warm-up steps left out of every figure")
    parser.add_argument("--rounds", type=int, default=2,
                        help="speed runs of each configuration, one round after the other; the "
                             "fastest counts")
    parser.add_argument("--retry-above", type=float, default=0.3,
                        help="a speed run during which other jobs kept more than this many cores "
                             "busy is run once more")
    parser.add_argument("--bubble-steps", type=int, default=5, help="steps of each bubble run")
    parser.add_argument("--bubble-rounds", type=int, default=2,
                        help="runs of each bubble measurement, one round after the other; the "
                             "least disturbed counts")
    parser.add_argument("--bubble-micro-batch", type=int, default=2,
                        help="micro batch size of the bubble runs")
    parser.add_argument("--no-four", action="store_true",
                        help="leave out PP=2 x DP=2 (4 processes on the 2 cores)")
    parser.add_argument("--work", type=Path, default=WORK / "pipeline",
                        help="data, model JSONs, the runs' logs and results.json")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from WORK/results.json without running")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if min(args.steps, args.bubble_steps) <= args.skip or min(args.rounds,
                                                              args.bubble_rounds) < 1:
        sys.exit("--steps and --bubble-steps must exceed --skip, and the rounds be at least 1")
    saved = args.work / "results.json"
    if args.report_only:
        if not saved.exists():
            sys.exit(f"{saved} does not exist: run the bench first")
        data = json.loads(saved.read_text())
        speed_rows = [SpeedRow(**dict(r, hwm={int(k): v for k, v in r["hwm"].items()}))
                      for r in data["speed"]]
        bubble_rows = [BubbleRow(**dict(r, hwm={int(k): v for k, v in r["hwm"].items()}))
                       for r in data["bubble"]]
        for key, value in data["args"].items():
            setattr(args, key, value)
        wall, commit = data["wall_s"], data.get("commit", "")
    else:
        commit = git_commit()
        started = time.perf_counter()
        paths = prepare_data(args.work)
        configs = list(CONFIGS) + ([] if args.no_four else [FOUR])
        speed_rows = [SpeedRow(name, nproc, layout) for name, nproc, layout, _ in configs]
        for round_ in range(args.rounds):
            for index, ((name, _, _, extra), row) in enumerate(zip(configs, speed_rows)):
                time_config(row, extra, paths, args, index, round_)
                if row.others[-1] > args.retry_above:  # once: a disturbed run, run again
                    time_config(row, extra, paths, args, index, round_ + args.rounds)
                print(f"round {round_ + 1}, {name}: {row.speeds[-1]:.3f} steps/s (others "
                      f"{row.others[-1]:.2f} cores), peak RSS "
                      f"{' / '.join(gib(row.hwm[k]) for k in sorted(row.hwm))} GiB; "
                      f"{time.perf_counter() - started:.0f} s so far", flush=True)
        bubble_rows: List[BubbleRow] = []
        for round_ in range(args.bubble_rounds):
            for index, m in enumerate(MICRO_BATCHES):
                row = measure_bubble(m, paths, args, round_)
                print(f"round {round_ + 1}, bubble, m = {m}: idle {row.idle[0]:.3f} / "
                      f"{row.idle[1]:.3f} (formula {row.formula:.3f}, with the measured stage "
                      f"times {row.modelled:.3f}), others {row.others:.2f} cores; "
                      f"{time.perf_counter() - started:.0f} s so far", flush=True)
                if round_ == 0:
                    bubble_rows.append(row)
                kept = bubble_rows[index]
                kept.rounds.append([statistics.mean(row.idle), row.others])
                if row.others < kept.others:
                    row.rounds = kept.rounds
                    bubble_rows[index] = row
        wall = time.perf_counter() - started
        saved.write_text(json.dumps({
            "speed": [asdict(r) for r in speed_rows], "bubble": [asdict(r) for r in bubble_rows],
            "wall_s": wall, "commit": commit, "args": {k: getattr(args, k) for k in (
                "steps", "skip", "rounds", "retry_above", "bubble_steps", "bubble_rounds",
                "bubble_micro_batch", "no_four")}},
            indent=1))
    body = reflow(report(speed_rows, bubble_rows, args, wall, commit))
    print(body)
    if not args.no_write:
        write_section("pipeline", body)
    return 0


def reflow(text: str, width: int = 96) -> str:
    """The report's prose paragraphs filled to `width`; headings, tables and the Command and
    Machine lines as they are."""
    import textwrap

    paragraphs = []
    for block in text.strip("\n").split("\n\n"):
        if block.startswith(("#", "|", "Command:")):
            paragraphs.append(block)
        else:
            paragraphs.append(textwrap.fill(" ".join(block.split()), width,
                                            break_on_hyphens=False))
    return "\n\n".join(paragraphs) + "\n"


def report(speed_rows: List[SpeedRow], bubble_rows: List[BubbleRow], args, wall: float,
           commit: str) -> str:
    import torch

    peer = speed_rows[0].speed
    speed_lines = markdown_table(
        ["configuration", "processes", "layout", "steps/s", "step (s) min-max",
         "rounds (steps/s)", "others' CPU (cores)", "vs DP=2", "peak RSS per rank (GiB)"],
        [[r.name, r.processes, r.layout, f"{r.speed:.3f}",
          f"{min(r.steps):.2f}-{max(r.steps):.2f}", " / ".join(f"{v:.3f}" for v in r.speeds),
          " / ".join(f"{v:.2f}" for v in r.others), f"**{r.speed / peer:.2f}**",
          " / ".join(gib(r.hwm[k]) for k in sorted(r.hwm))] for r in speed_rows])
    bubble_lines = markdown_table(
        ["m", "global batch", "(P - 1) / (m + P - 1)", "measured idle, stage mean", "stage 0",
         "stage 1", "with measured stage times", "work per micro-batch, stage 0 / 1 (ms)",
         "window, stage 0 / 1 (s)", "rank 0 step (s)", "rounds: idle (others' CPU)"],
        [[r.micro_batches, r.micro_batch_size * r.micro_batches, f"{r.formula:.3f}",
          f"**{statistics.mean(r.idle):.3f}**", f"{r.idle[0]:.3f}", f"{r.idle[1]:.3f}",
          f"{r.modelled:.3f}", " / ".join(f"{1000 * b / r.micro_batches:.0f}" for b in r.busy),
          " / ".join(f"{w:.2f}" for w in r.window), f"{r.step_s:.2f}",
          " / ".join(f"{idle:.3f} ({others:.2f})" for idle, others in r.rounds)]
         for r in bubble_rows])
    part_rows = []
    for r in bubble_rows:
        for stage, parts in enumerate(r.parts):
            cells = [1000 * parts.get(k, 0.0) for k in PARTS]
            rest = 1000 * parts["window"] - sum(cells[:-2])  # the window's untimed remainder
            part_rows.append([r.micro_batches, stage, *(f"{c:.0f}" for c in cells[:-2]),
                              f"{rest:.0f}", *(f"{c:.0f}" for c in cells[-2:])])
    part_lines = markdown_table(["m", "stage", *PARTS[:-2], "rest", *PARTS[-2:]], part_rows,
                                "r" * (len(PARTS) + 3))
    command = "python bench/bench_pipeline.py" + "".join(
        f" --{name.replace('_', '-')} {getattr(args, name)}"
        for name, default in (("steps", 6), ("skip", 2), ("rounds", 2), ("retry_above", 0.3),
                              ("bubble_steps", 5),
                              ("bubble_rounds", 2), ("bubble_micro_batch", 2))
        if getattr(args, name) != default) + (" --no-four" if args.no_four else "")
    four = "" if args.no_four else (
        f" **{FOUR[0]}: 4 processes on the 2 cores, oversubscribed** (two ranks share each core, "
        "so the figure measures the sharing as much as the layout).")
    b = args.bubble_micro_batch
    gaps = [(statistics.mean(r.idle) - r.formula, r.modelled - r.formula,
             statistics.mean(r.idle) - r.modelled) for r in bubble_rows]
    heavier = statistics.mean(r.busy[1] / r.busy[0] - 1 for r in bubble_rows)  # > 0: stage 1
    reduce_ms = [1000 * statistics.median(r.parts[k].get("ReduceGrads", 0.0) for r in bubble_rows)
                 for k in (0, 1)]
    summary = (
        "Measured minus formula: " + ", ".join(
            f"{g[0]:+.3f} (m = {r.micro_batches})" for g, r in zip(gaps, bubble_rows))
        + f". Stage {int(heavier > 0)} does {100 * abs(heavier):.0f}% more work per micro-batch "
        f"than stage {int(heavier <= 0)} (the cut balances forward FLOPs, not time), and that "
        "imbalance accounts for " + ", ".join(f"{g[1]:+.3f}" for g in gaps)
        + " (the model with measured stage times); the rest, "
        + ", ".join(f"{g[2]:+.3f}" for g in gaps) + ", is what the engine adds: the transfers, the "
        "micro-batch loads and the tied-gradient all-reduce. Outside the window, ReduceGrads "
        f"takes {reduce_ms[0]:.0f} ms per step on stage 0 and {reduce_ms[1]:.0f} ms on stage 1 "
        "(with one data-parallel rank under ZeRO-0 the pipeline step turns DeepSpeed's "
        "all-reduce over a group of one off; before that it cost 35 and 74 ms).")
    return f"""## pipeline (PP=2 against DP=2 on CPU; the bubble)

Command: `{command}` ({wall / 60:.1f} min){f" at commit {commit}" if commit else ""}

Machine: {machine_line()}, torch {torch.__version__}, DeepSpeed {deepspeed_version()}; gloo, one
thread per rank (OMP_NUM_THREADS=1). Model and data: bench_training's ({model_size()} parameters,
d_model 512, 4 + 4 layers, encoder {ENC_LEN} / decoder 58 tokens, fp32, AdamW, dropout 0). The
pipeline's cut by layer cost: {"; ".join(bubble_rows[0].cut)}.

Speed and memory at global batch {GLOBAL_BATCH} (layout: micro batch x micro-batches per step x
data-parallel ranks). Each configuration runs {args.rounds} rounds of {args.steps} steps (all
configurations, then all again); a round's steps/s is the mean of rank 0's logged step time over
steps {args.skip + 1}-{args.steps}, the fastest round counts, and the ratio is to DP=2, ZeRO 0's
fastest. Peak RSS: each rank's VmHWM (read from /proc every 0.05 s), glibc's default allocator,
the highest of the rounds, rank 0 first (PP=2: rank 0 holds stage 0; PP=2 x DP=2: ranks 0-1
stage 0, ranks 2-3 stage 1). "others'
CPU": the cores other jobs kept busy during each run (busy time in /proc/stat less this bench's
own); a run during which they kept more than {args.retry_above} cores busy is repeated once, and
"rounds" lists every run.{four}

{chr(10).join(speed_lines)}

With m = 2 micro-batches, the formula's bubble is 1/3 of a PP=2 step's schedule; each pipeline
rank holds about half of the model states, hence the lower peak RSS.

The bubble: PP=2, ZeRO 0, micro batch {b}, m micro-batches per step, 2 processes on the 2 cores
(one core each, one thread each), {args.bubble_steps} steps, the first {args.skip} left out. In
each rank every instruction of DeepSpeed's schedule is timed (the timers wrap
PipelineEngine._INSTRUCTION_MAP's entries in a worker that then runs the entry point).
**window**: a step's time from train_batch's start to the end of ReduceTiedGrads, where the
stages meet after the last backward pass (forward and backward passes, sends, receives, the
all-reduce of the tied weights' gradients; the data-parallel reduction and the optimizer step
after it are not part of the schedule the formula models). **busy**: the time in ForwardPass +
BackwardPass. **idle** = 1 - busy / window, the median over the timed steps, per stage; the
figure compared is the mean of the two stages. **with measured stage times**: the same 1F1B
model with each stage's measured work per micro-batch t_s instead of equal stages (step = t_0 +
t_1 + (m - 1) max t_s, idle_s = 1 - m t_s / step; equal t_s give the formula), which takes out
the imbalance of the cut. Each m runs in {args.bubble_rounds} round(s) (all m, then all again);
the round in which other jobs kept the fewest cores busy counts (a stage slowed by another job
makes the other wait); "rounds" lists each round's stage-mean idle (others' CPU in cores).

{chr(10).join(bubble_lines)}

{summary}

Where a step's time went, per stage (ms in each instruction kind during the timed step with
the median window, in the counted round). A wait for the other stage sits inside a receive,
inside a send (gloo's send returns only once the peer has posted the matching receive) or, for
the stage that finishes its backward passes first, inside the tied-gradient all-reduce; "rest":
the window less the timed instructions; ReduceGrads and OptimizerStep come after the window:

{chr(10).join(part_lines)}

Peak RSS of the bubble runs (rank 0 / 1, GiB): {"; ".join(
        f"m = {r.micro_batches}: {' / '.join(gib(r.hwm[k]) for k in sorted(r.hwm))}"
        for r in bubble_rows)}.
"""


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
