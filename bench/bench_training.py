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
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, WORK, corpora_dir, machine_line, write_section  # noqa: E402

MODEL = dict(vocab_size=8100, d_model=512, d_kv=64, d_ff=1024, num_layers=4,
             num_decoder_layers=4, num_heads=8, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False, dropout_rate=0.0)
TINY = dict(MODEL, d_model=64, d_kv=32, d_ff=128, num_layers=1, num_decoder_layers=1,
            num_heads=2)
CORPORA = ("en_wikitext2.jsonl", "en_shakespeare.jsonl")
MICRO_BATCH, ENC_LEN = 4, 256
GIB = 2 ** 30

CONFIGS = [
    ("ZeRO 0", ["--zero-stage", "0"]),
    ("ZeRO 1", ["--zero-stage", "1"]),
    ("ZeRO 2", ["--zero-stage", "2"]),
    ("ZeRO 3", ["--zero-stage", "3"]),
    ("ZeRO 2 + offload optimizer", ["--zero-stage", "2", "--offload-optimizer", "cpu"]),
    ("ZeRO 3 + offload optimizer, params", ["--zero-stage", "3", "--offload-optimizer", "cpu",
                                            "--offload-param", "cpu"]),
]
BF16 = ("bf16, ZeRO 1", ["--zero-stage", "1", "--bf16"])
STEP_RE = re.compile(r" iteration\s+(\d+)/.*\| mem: ([\d.]+) GiB \|.*\| step: ([\d.]+) s")


def native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (else torch emulates bf16 GEMMs)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Data ---------------------------------------------------------------------------------------
def prepare_data(work: Path) -> Dict[str, Path]:
    """Tokenizer, .bin/.idx and the two model JSONs under `work` (reused when present)."""
    work.mkdir(parents=True, exist_ok=True)
    inputs = [str(corpora_dir() / name) for name in CORPORA]
    tokenizer, prefix = work / "spm.model", work / "en"
    if not tokenizer.exists():
        _check([sys.executable, str(REPO / "data_tools" / "train_tokenizer.py"), "--input",
                *inputs, "--output-prefix", str(work / "spm"), "--vocab-size", "8000",
                "--character-coverage", "1.0"])
    if not Path(f"{prefix}_text_document.idx").exists():
        _check([sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input",
                *inputs, "--output-prefix", str(prefix), "--tokenizer-model", str(tokenizer),
                "--append-eod", "--workers", "2", "--no-progress"])
    paths = {"tokenizer": tokenizer, "data": Path(f"{prefix}_text_document")}
    for name, fields in (("model", MODEL), ("tiny", TINY)):
        paths[name] = work / f"{name}.json"
        paths[name].write_text(json.dumps(fields, indent=1) + "\n")
    return paths


def _check(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


def train_flags(paths: Dict[str, Path], model: str, steps: int, extra: Sequence[str]) -> List[str]:
    return ["--data-path", str(paths["data"]), "--tokenizer-model", str(paths["tokenizer"]),
            "--model-config", str(paths[model]), "--micro-batch-size", str(MICRO_BATCH),
            "--encoder-seq-length", str(ENC_LEN), "--lr", "1e-4", "--train-iters", str(steps),
            "--split", "1000,0,0", "--eval-iters", "0", "--log-interval", "1",
            "--num-workers", "0", *extra]


# One run ------------------------------------------------------------------------------------
ALLOCATOR_NEUTRAL = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc then maps every block of 128 KiB or more on its own and unmaps it when freed, so the
resident set follows the live tensors; by default it raises that threshold as blocks are freed
and keeps freed memory in its heaps, and the resident set creeps up step after step."""


@dataclass
class Run:
    step_s: Dict[int, float] = field(default_factory=dict)
    """iteration -> rank 0's logged step time."""
    logged_at: Dict[int, float] = field(default_factory=dict)
    """iteration -> when its log line arrived (perf_counter)."""
    logged_mem: float = 0.0
    """rank 0's last `mem:` field (its ru_maxrss), bytes."""
    hwm: Dict[int, int] = field(default_factory=dict)
    """rank -> peak resident bytes (VmHWM)."""
    rss: List[tuple] = field(default_factory=list)
    """(time, rank, VmRSS bytes) samples."""
    wall_s: float = 0.0
    others_cpu: float = 0.0
    """CPU time the rest of the machine used meanwhile, in cores (busy time in /proc/stat less
    this process and its children's): other jobs on the host slow the run."""

    def between_steps(self) -> int:
        """The lowest resident set during step 2 (at its start no activations exist yet), the
        higher of the two ranks. A step shorter than the sampling interval (the tiny model's)
        takes the samples within half a second of it."""
        start, end = self.logged_at[1], self.logged_at[2]
        lows = []
        for k in (0, 1):
            for slack in (0.0, 0.5):
                found = [r for t, rank, r in self.rss
                         if rank == k and start - slack <= t <= end + slack]
                if found:
                    lows.append(min(found))
                    break
            else:
                raise RuntimeError(f"no resident-set sample of rank {k} around step 2")
        return max(lows)


def _status(pid: int) -> Optional[Dict[str, int]]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("VmHWM:", "VmRSS:"))}
    except (OSError, ValueError):
        return None


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and iowait) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    import resource

    return sum(getattr(resource.getrusage(who), kind) for who in
               (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for kind in ("ru_utime", "ru_stime"))


def _rank_of(pid: int) -> Optional[int]:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def run_torchrun(flags: Sequence[str], log: Path, env: Optional[Dict[str, str]] = None,
                 interval: float = 0.05, nproc: int = 2,
                 module: str = "megatron.pretrain_t5") -> Run:
    """`torchrun --nproc_per_node NPROC -m MODULE FLAGS` with `env` added; its output goes to
    `log`. The ranks are torchrun's children, told apart by RANK in their environment."""
    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(29500 + os.getpid() % 1000), "-m", module, *flags]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    run, ranks = Run(), {}
    start, busy, own = time.perf_counter(), _busy_seconds(), _own_seconds()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, text=True)
    launcher = psutil.Process(proc.pid)

    def sample():
        while proc.poll() is None:
            try:
                children = launcher.children()
            except psutil.NoSuchProcess:
                break
            now = time.perf_counter()
            for child in children:
                if ranks.get(child.pid) is None:
                    ranks[child.pid] = _rank_of(child.pid)
                status, rank = _status(child.pid), ranks[child.pid]
                if status and rank is not None and "VmHWM" in status:
                    run.hwm[rank] = max(run.hwm.get(rank, 0), status["VmHWM"])
                    run.rss.append((now, rank, status["VmRSS"]))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    with open(log, "w") as out:
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            match = STEP_RE.match(line)
            if match:
                iteration = int(match.group(1))
                run.logged_at[iteration] = time.perf_counter()
                run.step_s[iteration] = float(match.group(3))
                run.logged_mem = float(match.group(2)) * GIB
    proc.wait()
    sampler.join()
    run.wall_s = time.perf_counter() - start
    run.others_cpu = max(0.0, (_busy_seconds() - busy) - (_own_seconds() - own)) / run.wall_s
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log}\n"
                 + "".join(lines[-30:]))
    if sorted(run.hwm) != list(range(nproc)):
        sys.exit(f"could not read the peak memory of every rank (got ranks {sorted(run.hwm)})")
    return run


# The estimates ------------------------------------------------------------------------------
def dry_run_total(config, device: str) -> float:
    """'total on device' in bytes as `--dry-run --dry-run-device DEVICE` prints it."""
    import contextlib
    import dataclasses
    import io

    from megatron.pretrain_t5 import dry_run

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        dry_run(dataclasses.replace(config, dry_run_device=device))
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


def gib(n: float) -> str:
    return f"{n / GIB:.3f}"


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
        speed_rows.append(
            f"| {r.name} | {r.speed:.3f} | {min(r.steps):.2f}-{max(r.steps):.2f} | "
            f"{' / '.join(f'{v:.3f}' for v in r.speeds)} | "
            f"{' / '.join(f'{v:.2f}' for v in r.others)} | **{r.speed / peer:.2f}** | "
            f"{gib(r.hwm[0])} | {gib(r.hwm[1])} |")
        # the baseline: what a run holds besides the estimate's terms, from the tiny model
        baseline = r.tiny_peak - r.tiny_estimate
        measured = r.memory_peak - baseline
        states = r.memory_between - (r.tiny_between - r.tiny_estimate_between)
        ratios.append(r.estimate / measured)
        if abs(r.estimate_between / states - 1) > 0.1:
            gaps.append((r.name, states - r.estimate_between))
        memory_rows.append(
            f"| {r.name} | {gib(r.memory_peak)} | {gib(baseline)} | {gib(measured)} | "
            f"{gib(r.estimate)} | **{r.estimate / measured:.2f}** | {gib(states)} | "
            f"{gib(r.estimate_between)} | {r.estimate_between / states:.2f} | "
            f"{gib(r.dry_run_cuda)} | {r.dry_run_cuda / measured:.2f} |")
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
    command = "python bench/bench_training.py" + (
        f" --steps {args.steps}" if args.steps != 8 else "") + (
        f" --skip {args.skip}" if args.skip != 2 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 2 else "")
    return f"""## training (ZeRO stages on CPU)

Command: `{command}` ({wall / 60:.1f} min)
Machine: {machine_line()}, torch {torch.__version__}, DeepSpeed {_deepspeed_version()}; two
processes under `torchrun --nproc_per_node 2`, gloo, one thread each. Model: d_model 512, 8 heads
x 64, d_ff 1024 gated-gelu, 4 + 4 layers, untied, vocabulary 8100 padded to 8192
({_count()} parameters); encoder {ENC_LEN} / decoder {rows[0].decoder_seq_length} tokens, micro
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

| configuration | steps/s | step (s) min-max | rounds (steps/s) | others' CPU (cores) | vs ZeRO 0 | peak RSS rank 0 (GiB) | rank 1 (GiB) |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(speed_rows)}

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

| configuration | peak (GiB) | baseline | measured | estimate | estimate / measured | between steps, measured | estimated | ratio | cuda | cuda / measured |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(memory_rows)}

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


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _count() -> str:
    from megatron.model.config import T5Config
    from megatron.cost.memory import count_parameters

    return f"{count_parameters(T5Config(**MODEL), 1, 128) / 1e6:.1f} M"


def _bucket_gib() -> str:
    from megatron.cost.memory import ZeroBuckets

    return f"{4 * ZeroBuckets().reduce_bucket_size / GIB:.2f}"


if __name__ == "__main__":
    sys.exit(main())
