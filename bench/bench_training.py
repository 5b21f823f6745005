"""Two-process CPU training under each ZeRO stage: steady-state steps/s, peak memory per rank,
and the memory estimate against the measured peak.

    python bench/bench_training.py [--steps 8] [--skip 2] [--rounds 2] [--work DIR] [--report-only]
                                   [--no-write]

Data: the English test corpora (3.6 MB), a SentencePiece tokenizer of 8000 pieces (+100
sentinels) and their .bin/.idx, made once under --work (default bench/work/training, ignored by
git). Model: d_model 512, 8 heads x 64, d_ff 1024 gated-gelu, 4 + 4 layers, untied, vocabulary
8100 (padded to 8192), 33.6 M parameters; encoder 256 / decoder 58 tokens (span corruption),
micro batch 4 per rank, fp32, AdamW. Each configuration is `torchrun --nproc_per_node 2` with
gloo and one thread per rank (torchrun's default).

Speed: the mean of rank 0's logged ` step: X s` (--log-interval 1) after the first --skip steps.
The host may be shared and drifts: every configuration runs in --rounds rounds (all of them,
then all again), the fastest round counts, and each run records how many cores other jobs kept
busy meanwhile. The ratio is to ZeRO 0's fastest round.

Memory: each rank's VmHWM (the kernel's high-water mark of its resident set), read from
/proc/<pid>/status every 0.05 s; the mark never falls, so only the last 0.05 s (teardown) can be
missed; rank 0's own ru_maxrss (the `mem:` field) is the cross-check. For the estimate, each
configuration runs 2 more steps with glibc's mmap threshold fixed (`ALLOCATOR_NEUTRAL`) and the
same command with a tiny model gives the baseline the estimate does not model (interpreter,
torch, DeepSpeed, gloo, data); the report explains the columns. Results go to bench/RESULTS.md
and the figures to WORK/results.json (--report-only rewrites the report from them).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    ALLOCATOR_NEUTRAL,
    CONFIGS,
    ENC_LEN,
    GIB,
    WORK,
    deepspeed_version,
    gib,
    machine_line,
    markdown_table,
    model_size,
    native_bf16,
    prepare_data,
    run_torchrun,
    train_flags,
    write_section,
)

BF16 = ("bf16, ZeRO 1", ["--zero-stage", "1", "--bf16"])

# The estimates ------------------------------------------------------------------------------
def dry_run_total(config, device: str) -> float:
    """'total on device' in bytes as `--dry-run --dry-run-device DEVICE` prints it."""
    import contextlib
    import dataclasses
    import io

    from megatron.cost.report import print_dry_run

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_dry_run(dataclasses.replace(config, dry_run_device=device))
    match = re.search(r"total on device\s+([\d.]+) GiB", printed.getvalue())
    if match is None:
        sys.exit(f"no 'total on device' line in the dry run's output:\n{printed.getvalue()}")
    return float(match.group(1)) * GIB


def estimates(flags: Sequence[str]):
    """(the CPU estimate, `--dry-run`'s total for this machine, for cuda, the run's config) for
    `flags`, resolved for 2 processes (WORLD_SIZE=2). The estimate is `estimate_run` for the
    CPU (the eager attention that 'auto' runs there, DeepSpeed's buckets from the resolved
    config and the accumulation steps): what `--dry-run` prints on a CPU machine, with the
    fields it does not print (`between_steps`)."""
    from megatron.arguments import parse_args
    from megatron.cost.memory import estimate_run

    config = parse_args(list(flags), env={"WORLD_SIZE": "2"})
    cpu = estimate_run(config.layout(), "cpu")
    return cpu, dry_run_total(config, "auto"), dry_run_total(config, "cuda"), config


# Main ---------------------------------------------------------------------------------------
@dataclass
class Row:
    """One configuration's figures (bytes, seconds), as saved in WORK/results.json."""

    name: str
    decoder_seq_length: int
    estimate: int
    estimate_between: int
    dry_run: float
    dry_run_cuda: float
    speeds: List[float] = field(default_factory=list)
    """steps/s of each round."""
    others: List[float] = field(default_factory=list)
    """cores other jobs kept busy during each round's run."""
    steps: List[float] = field(default_factory=list)
    """the fastest round's timed step times."""
    hwm: Dict[int, int] = field(default_factory=dict)
    """rank -> peak resident bytes, the highest over the rounds."""
    logged_gap: float = 0.0
    """the largest relative gap between rank 0's logged ru_maxrss and its VmHWM."""
    memory_peak: int = 0
    memory_between: int = 0
    tiny_peak: int = 0
    tiny_between: int = 0
    tiny_estimate: int = 0
    tiny_estimate_between: int = 0

    @property
    def speed(self) -> float:
        return max(self.speeds)


def new_row(name: str, extra: Sequence[str], paths, args) -> Row:
    cpu, dry, dry_cuda, resolved = estimates(train_flags(paths, "model", args.steps, extra))
    return Row(name=name, decoder_seq_length=resolved.data.decoder_seq_length, estimate=cpu.total,
               estimate_between=cpu.between_steps, dry_run=dry, dry_run_cuda=dry_cuda)


def time_once(row: Row, extra: Sequence[str], paths, args, log: Path) -> None:
    """One timed run of `args.steps` steps with the default allocator, added to `row`."""
    timed = run_torchrun(train_flags(paths, "model", args.steps, extra), log)
    times = [t for it, t in sorted(timed.step_s.items()) if it > args.skip]
    if len(times) != args.steps - args.skip:
        sys.exit(f"{row.name}: expected {args.steps} logged steps, found {len(timed.step_s)} "
                 f"(see {log})")
    speed = 1 / statistics.mean(times)
    if not row.speeds or speed > row.speed:
        row.steps = times
    row.speeds.append(speed)
    row.others.append(timed.others_cpu)
    row.hwm = {k: max(v, row.hwm.get(k, 0)) for k, v in timed.hwm.items()}
    row.logged_gap = max(row.logged_gap, abs(timed.logged_mem - timed.hwm[0]) / timed.hwm[0])


def measure_memory(row: Row, extra: Sequence[str], paths, args, index: int) -> None:
    """The allocator-neutral runs of the model and of the tiny model, 2 steps each: the peak
    comes in step 2 (ZeRO-3 prefetches from then on)."""
    memory = run_torchrun(train_flags(paths, "model", 2, extra),
                          args.work / f"run{index}_memory.log", ALLOCATOR_NEUTRAL)
    tiny_flags = train_flags(paths, "tiny", 2, extra)
    tiny_cpu = estimates(tiny_flags)[0]
    tiny = run_torchrun(tiny_flags, args.work / f"run{index}_tiny.log", ALLOCATOR_NEUTRAL)
    row.memory_peak, row.memory_between = max(memory.hwm.values()), memory.between_steps()
    row.tiny_peak, row.tiny_between = max(tiny.hwm.values()), tiny.between_steps()
    row.tiny_estimate, row.tiny_estimate_between = tiny_cpu.total, tiny_cpu.between_steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps of each timed run")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the speed")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed runs of each configuration, one round after the other; the "
                             "fastest counts")
    parser.add_argument("--work", type=Path, default=WORK / "training",
                        help="data, model JSONs, the runs' logs and results.json")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from WORK/results.json without running")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.steps <= args.skip or args.rounds < 1:
        sys.exit("--steps must exceed --skip, and --rounds be at least 1")
    saved = args.work / "results.json"
    if args.report_only:
        if not saved.exists():
            sys.exit(f"{saved} does not exist: run the bench first")
        data = json.loads(saved.read_text())
        rows = [Row(**dict(r, hwm={int(k): v for k, v in r["hwm"].items()}))
                for r in data["rows"]]
        args.steps, args.skip, args.rounds = (data["args"][k] for k in ("steps", "skip", "rounds"))
        wall = data["wall_s"]
    else:
        started = time.perf_counter()
        paths = prepare_data(args.work)
        configs = list(CONFIGS) + ([BF16] if native_bf16() else [])
        rows = [new_row(name, extra, paths, args) for name, extra in configs]
        for round_ in range(args.rounds):
            for index, ((name, extra), row) in enumerate(zip(configs, rows)):
                time_once(row, extra, paths, args, args.work / f"run{index}_{round_}.log")
                line = (f"round {round_ + 1}, {name}: {row.speeds[-1]:.3f} steps/s (others "
                        f"{row.others[-1]:.2f} cores), peak RSS {gib(row.hwm[0])} / "
                        f"{gib(row.hwm[1])} GiB")
                if round_ == 0:
                    measure_memory(row, extra, paths, args, index)
                    line += (f"; allocator-neutral peak {gib(row.memory_peak)}, tiny "
                             f"{gib(row.tiny_peak)}, estimate {gib(row.estimate)}")
                print(line + f"; {time.perf_counter() - started:.0f} s so far", flush=True)
        wall = time.perf_counter() - started
        saved.write_text(json.dumps({"rows": [asdict(r) for r in rows], "wall_s": wall, "args": {
            k: getattr(args, k) for k in ("steps", "skip", "rounds")}}, indent=1))
    body = report(rows, args, wall)
    print(body)
    if not args.no_write:
        write_section("training", body)
    return 0


def report(rows: List[Row], args, wall: float) -> str:
    import torch

    peer = rows[0].speed
    speed_rows, memory_rows, ratios, gaps = [], [], [], []
    for r in rows:
        speed_rows.append([r.name, f"{r.speed:.3f}", f"{min(r.steps):.2f}-{max(r.steps):.2f}",
                           " / ".join(f"{v:.3f}" for v in r.speeds),
                           " / ".join(f"{v:.2f}" for v in r.others), f"**{r.speed / peer:.2f}**",
                           gib(r.hwm[0]), gib(r.hwm[1])])
        # the baseline: what a run holds besides the estimate's terms, from the tiny model
        baseline = r.tiny_peak - r.tiny_estimate
        measured = r.memory_peak - baseline
        states = r.memory_between - (r.tiny_between - r.tiny_estimate_between)
        ratios.append(r.estimate / measured)
        if abs(r.estimate_between / states - 1) > 0.1:
            gaps.append((r.name, states - r.estimate_between))
        memory_rows.append([r.name, gib(r.memory_peak), gib(baseline), gib(measured),
                            gib(r.estimate), f"**{r.estimate / measured:.2f}**", gib(states),
                            gib(r.estimate_between), f"{r.estimate_between / states:.2f}",
                            gib(r.dry_run_cuda), f"{r.dry_run_cuda / measured:.2f}"])
    spreads = [max(r.speeds) / min(r.speeds) for r in rows]
    dry_same = all(abs(r.dry_run - r.estimate) < 0.0015 * GIB for r in rows)
    dry_note = ("`--dry-run` on this machine prints the estimate column (checked for every row)."
                if dry_same else "**`--dry-run` on this machine prints something else than the "
                "estimate column**: " + ", ".join(f"{r.name} {gib(r.dry_run)}" for r in rows)
                + " GiB.")
    if native_bf16():
        bf16_note = "bf16 ZeRO 1 is run: this CPU has bf16 instructions."
    else:
        bf16_note = ("bf16 ZeRO 1 is not run: this CPU has neither avx512_bf16 nor amx_bf16 "
                     "(/proc/cpuinfo), so torch emulates bf16 GEMMs, tens of times slower than "
                     "fp32 (see the model section), and a timing would measure the emulation.")
    speed_table = "\n".join(markdown_table(
        ["configuration", "steps/s", "step (s) min-max", "rounds (steps/s)",
         "others' CPU (cores)", "vs ZeRO 0", "peak RSS rank 0 (GiB)", "rank 1 (GiB)"],
        speed_rows))
    memory_table = "\n".join(markdown_table(
        ["configuration", "peak (GiB)", "baseline", "measured", "estimate",
         "estimate / measured", "between steps, measured", "estimated", "ratio", "cuda",
         "cuda / measured"], memory_rows))
    command = "python bench/bench_training.py" + (
        f" --steps {args.steps}" if args.steps != 8 else "") + (
        f" --skip {args.skip}" if args.skip != 2 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 2 else "")
    return f"""## training (ZeRO stages on CPU)

Command: `{command}` ({wall / 60:.1f} min)
Machine: {machine_line()}, torch {torch.__version__}, DeepSpeed {deepspeed_version()}; two
processes under `torchrun --nproc_per_node 2`, gloo, one thread each. Model: d_model 512, 8 heads
x 64, d_ff 1024 gated-gelu, 4 + 4 layers, untied, vocabulary 8100 padded to 8192
({model_size()} parameters); encoder {ENC_LEN} / decoder {rows[0].decoder_seq_length} tokens, micro
batch 4 per rank (global 8), fp32, AdamW, dropout 0. Data: the English test corpora (3.6 MB),
SentencePiece 8000 pieces + 100 sentinels.

Speed: each configuration is timed in {args.rounds} rounds (all configurations, then all again);
a round's steps/s is the mean of rank 0's logged step time over steps {args.skip + 1}-{args.steps}
(the first {args.skip} left out), and the fastest round counts, its ratio to ZeRO 0's fastest
being the comparison. "others' CPU": the cores other jobs kept busy during each round's run
(busy time in /proc/stat less this bench's own). Peak RSS: each rank's VmHWM (read from /proc
every 0.05 s; rank 0's own ru_maxrss in its log line agrees within
{100 * max(r.logged_gap for r in rows):.1f}%), with glibc's default allocator, the highest of the
rounds.

{speed_table}

This 2-core host is shared and its speed drifts by tens of percent within minutes, also with
nothing else running: the rounds of one configuration differ by up to
{100 * (max(spreads) - 1):.0f}% here, and the ratios carry that much uncertainty. {bf16_note}

Estimate against measurement. Each configuration runs again for 2 steps (ZeRO-3's prefetching
starts in step 2, where the peak comes) with `MALLOC_MMAP_THRESHOLD_=131072`, which keeps glibc
from holding freed blocks, so the resident set follows the live tensors as the estimate does (by
default it creeps up step after step: compare the table above). **baseline**: what a run holds
besides the estimate's terms (interpreter, torch, DeepSpeed, gloo, tokenizer, data), taken as
the peak of the same command with a tiny model (d_model 64, 1 + 1 layers, same vocabulary,
batch and lengths) less that model's own estimate. **measured** = peak - baseline. **estimate**:
`estimate_run(config, "cpu")` (eager attention, as on the CPU) with the resolved flags;
{dry_note} **between steps**: the lowest resident set in step 2 (model states and kept buffers
only), less the tiny run's, against the estimate's `between_steps`. **cuda**: what
`--dry-run --dry-run-device cuda` prints for the same flags, for contrast: everything alive at
once and DeepSpeed's 500 M-element reduce buckets allocated whole ({_bucket_gib()} GiB in fp32
for ZeRO 1-3), where a CPU run holds only the bucket pages it writes.

{memory_table}

Estimate / measured over the configurations: {min(ratios):.2f}-{max(ratios):.2f} (goal: within
20%). {_gaps(gaps)}
"""


def _gaps(gaps: List[tuple]) -> str:
    if not gaps:
        return "Between steps, every configuration is within 10% of the estimate."
    listed = "; ".join(f"{name}: {gib(gap)} GiB" for name, gap in gaps)
    text = f"Resident between steps beyond the estimate by more than 10%: {listed}."
    if any(name == CONFIGS[5][0] for name, _ in gaps):
        text += (f" With {CONFIGS[5][0]}, no tensor reachable from the engine, its optimizer or "
                 "the parameters accounts for it (checked by walking them after a step): memory "
                 "held inside DeepSpeed's or gloo's native code, left out of the estimate.")
    return text


def _bucket_gib() -> str:
    from megatron.cost.memory import ZeroBuckets

    return f"{4 * ZeroBuckets().reduce_bucket_size / GIB:.2f}"


if __name__ == "__main__":
    sys.exit(main())
