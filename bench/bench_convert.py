"""Checkpoint conversion: wall time and peak memory of data_tools/convert_checkpoint.py against
checkpoint size, beside DeepSpeed's zero_to_fp32 on the same ZeRO-3 checkpoints.

    python bench/bench_convert.py [--rounds 3] [--retry-above 0.3] [--retries 1] [--work DIR]
                                  [--fresh] [--report-only] [--no-write]

Checkpoints: one per model size in SIZES (about 0.4, 1.3 and 2.7 GB on disk), each a real
ZeRO-3, DP=2 run of the entry point (`torchrun --nproc_per_node 2`, gloo, CPU) trained for one
step with --save, on bench_training's data and tokenizer (vocabulary 8100, padded to 8192); micro
batch 1, encoder 64 tokens, fp32, AdamW. They are made once under --work (default
bench/work/convert, ignored by git) and reused unless --fresh or the model changed.

Tools, each a separate process on the same iteration folder, its output removed before each run:

    ours --to fp32     convert_checkpoint.py --load CKPT --to fp32 OUT --no-progress
    ours --to hf       convert_checkpoint.py --load CKPT --to hf OUT --no-progress
    DeepSpeed          python -m deepspeed.utils.zero_to_fp32 CKPT OUT --tag iter_0000001
                       (its default output, one pytorch_model.bin), and with
                       --safe_serialization (model.safetensors, the format ours writes)
    both again with 256 MB output shards (ours --max-shard-size 256MB, DeepSpeed
    --max_shard_size 256MB): DeepSpeed holds one output shard in memory at a time, 5 GB by
    default; ours writes each tensor to its shard file as it comes (megatron/checkpoint/formats/shards.py)

and `python -c "import deepspeed"`, what every tool's process costs before it reads anything
(both tools import deepspeed). Each runs --rounds times (every tool on every size, then again);
the fastest wall time counts. Before each run `sync` flushes what the runs before wrote (else
their writeback lands in the next run's time), and a run during which other jobs on the host
kept more than --retry-above cores busy (busy time in /proc/stat less this bench's own) is run
again, at most --retries times.

Measures, per process: wall time from spawn to exit (interpreter start-up and imports
included); peak RSS = the kernel's high-water mark of the resident set (VmHWM), exact, from
wait4's ru_maxrss; peak RssAnon (private memory: tensors, the interpreter) and peak RssFile
(file pages mapped into the process: the checkpoint files read through mmap, the shared
libraries), the highest values read from /proc/PID/status every 0.01 s (the kernel keeps no
high-water mark for them). VmHWM counts RssFile too: pages of a memory-mapped checkpoint that
are resident (in the page cache) and mapped count, although the kernel can drop them at will.
The checkpoints were just written or read, so every run reads them from the page cache (warm);
the outputs go into the page cache and are flushed later (neither tool fsyncs).

Check: the fp32 outputs are loaded and compared tensor by tensor (torch.equal) by name: ours
--to fp32, ours --to hf (read back with megatron.checkpoint.formats.hf.read_hf_folder, which gives our
names) and DeepSpeed's two outputs; DeepSpeed keeps the vocabulary's padded rows of
shared.weight and lm_head.weight, ours trims them to vocab_size, so its first vocab_size rows
are compared. Results go to bench/RESULTS.md (section "convert") and the figures to
WORK/results.json (--report-only rewrites the report from them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    GIB,
    MODEL,
    REPO,
    WORK,
    busy_seconds,
    deepspeed_version,
    machine_line,
    markdown_table,
    own_seconds,
    prepare_data,
    run_torchrun,
    train_flags,
    write_section,
)

if TYPE_CHECKING:
    import torch

TAG = "iter_0000001"
SHARD = "256MB"
SIZES = [
    # label, model (bench_training's vocabulary, untied, gated-gelu, dropout 0)
    ("d_model 512, 4 + 4 layers", MODEL),
    ("d_model 768, 6 + 6 layers", dict(MODEL, d_model=768, d_kv=64, d_ff=2048, num_layers=6,
                                       num_decoder_layers=6, num_heads=12)),
    ("d_model 1024, 7 + 7 layers", dict(MODEL, d_model=1024, d_kv=64, d_ff=2816, num_layers=7,
                                        num_decoder_layers=7, num_heads=16)),
]
CONVERT = [sys.executable, str(REPO / "data_tools" / "convert_checkpoint.py")]
ZERO_TO_FP32 = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32"]
TOOLS = [
    # name, command given the checkpoint folder and the output folder
    ("ours --to fp32", lambda ckpt, out: [*CONVERT, "--load", ckpt, "--to", "fp32", out,
                                              "--no-progress"]),
    ("ours --to hf", lambda ckpt, out: [*CONVERT, "--load", ckpt, "--to", "hf", out,
                                            "--no-progress"]),
    ("DeepSpeed zero_to_fp32", lambda ckpt, out: [*ZERO_TO_FP32, ckpt, out, "--tag", TAG]),
    ("DeepSpeed --safe_serialization", lambda ckpt, out: [
        *ZERO_TO_FP32, ckpt, out, "--tag", TAG, "--safe_serialization"]),
    (f"ours --to fp32, {SHARD} shards", lambda ckpt, out: [
        *CONVERT, "--load", ckpt, "--to", "fp32", out, "--no-progress", "--max-shard-size",
        SHARD]),
    (f"DeepSpeed --safe_serialization, {SHARD} shards", lambda ckpt, out: [
        *ZERO_TO_FP32, ckpt, out, "--tag", TAG, "--safe_serialization", "--max_shard_size",
        SHARD]),
]
TOOLS_BY_NAME = {name: (f"t{i}", command) for i, (name, command) in enumerate(TOOLS)}
"""name -> (its short name in file names, its command)."""
PEER = "DeepSpeed zero_to_fp32"
"""The ratios' peer."""
PEERS = {TOOLS[4][0]: TOOLS[5][0]}
"""The ratios' peer where it is not PEER: the sharded runs against each other."""
BASELINE = ("python -c 'import deepspeed'", [sys.executable, "-c", "import deepspeed"])


# One measured process -----------------------------------------------------------------------
@dataclass
class Measure:
    wall_s: float
    hwm: int
    """VmHWM at exit (wait4's ru_maxrss), bytes."""
    anon: int
    """the highest RssAnon sampled, bytes."""
    file: int
    """the highest RssFile sampled, bytes."""
    hwm_sampled: int
    """the highest VmHWM sampled (the cross-check of `hwm`)."""
    samples: int
    children: int
    """processes it started (none expected: a child's memory would not be counted)."""
    others_cpu: float


def _status(pid: int) -> Dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("VmHWM:", "RssAnon:", "RssFile:"))}
    except (OSError, ValueError, IndexError):
        return {}


def measure(cmd: Sequence[str], log: Path, interval: float = 0.01) -> Measure:
    """Run `cmd` (output to `log`), sampling /proc/PID/status; reaped with wait4 for the exact
    peak. Exits with the log's tail if the command fails."""
    import psutil

    busy, own = busy_seconds(), own_seconds()
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(list(cmd), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    done = threading.Event()
    peak = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0, "samples": 0, "children": 0}

    def sample():
        watched = psutil.Process(proc.pid)
        while not done.is_set():
            status = _status(proc.pid)
            if status:
                peak["samples"] += 1
                for key in ("VmHWM", "RssAnon", "RssFile"):
                    peak[key] = max(peak[key], status.get(key, 0))
                try:
                    peak["children"] = max(peak["children"], len(watched.children()))
                except psutil.Error:
                    pass
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output ({log}):\n"
                 + "".join(open(log).readlines()[-30:]))
    others = max(0.0, (busy_seconds() - busy) - (own_seconds() - own)) / wall
    return Measure(wall_s=wall, hwm=usage.ru_maxrss * 1024, anon=peak["RssAnon"],
                   file=peak["RssFile"], hwm_sampled=peak["VmHWM"], samples=peak["samples"],
                   children=peak["children"], others_cpu=others)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# The checkpoints ----------------------------------------------------------------------------
def make_checkpoint(paths: Dict[str, Path], index: int, model: dict, work: Path,
                    fresh: bool) -> dict:
    """A ZeRO-3 DP=2 checkpoint of `model` after one step, under WORK/ckpt<index>; reused when
    it exists for the same model (unless `fresh`). Returns what the report says about it."""
    ckpt = work / f"ckpt{index}"
    model_json = work / f"model{index}.json"
    text = json.dumps(model, indent=1) + "\n"
    stamp = ckpt / "bench_model.json"
    if not fresh and (ckpt / TAG / "meta.json").exists() and stamp.exists() \
            and stamp.read_text() == text:
        made = json.loads((ckpt / "bench_made.json").read_text())
        return dict(made, reused=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    model_json.write_text(text)
    flags = train_flags(dict(paths, **{f"model{index}": model_json}), f"model{index}", 1, [
        "--zero-stage", "3", "--micro-batch-size", "1", "--encoder-seq-length", "64",
        "--save", str(ckpt)])
    run = run_torchrun(flags, work / f"train{index}.log")
    if not (ckpt / TAG / "meta.json").exists():
        sys.exit(f"the training run wrote no {ckpt / TAG} (see {work / f'train{index}.log'})")
    made = {"train_wall_s": run.wall_s, "train_hwm": max(run.hwm.values())}
    (ckpt / "bench_made.json").write_text(json.dumps(made))
    stamp.write_text(text)
    return dict(made, reused=False)


# The check ----------------------------------------------------------------------------------
def _safetensors(folder: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _bins(folder: Path) -> Dict[str, torch.Tensor]:
    import torch

    tensors = {}
    for file in sorted(folder.glob("pytorch_model*.bin")):
        tensors.update(torch.load(file, map_location="cpu", mmap=True, weights_only=True))
    return tensors


def check_outputs(outs: Dict[str, Path], vocab_size: int) -> dict:
    """Compare every output with ours --to fp32, tensor by tensor, by name."""
    import torch

    from megatron.checkpoint.formats.hf import read_hf_folder

    reference = _safetensors(outs["ours --to fp32"] / TAG)
    found = {}
    for name, out in outs.items():
        if name == "ours --to fp32":
            continue
        if name.startswith("ours --to hf"):
            tensors = dict(read_hf_folder(out)[1])
        elif name.startswith("ours"):
            tensors = _safetensors(out / TAG)
        elif "safe_serialization" in name:
            tensors = _safetensors(out)
        else:
            tensors = _bins(out)
        differ, padded = [], {}
        if set(tensors) != set(reference):
            differ.append(f"names: {sorted(set(tensors) ^ set(reference))[:4]}")
        for key in sorted(set(tensors) & set(reference)):
            ours, theirs = reference[key], tensors[key]
            if theirs.shape != ours.shape and theirs.shape[1:] == ours.shape[1:] \
                    and theirs.shape[0] > ours.shape[0] == vocab_size:
                padded[key] = int(theirs.shape[0])
                theirs = theirs[:vocab_size]
            if theirs.dtype != ours.dtype or not torch.equal(theirs, ours):
                differ.append(key)
        found[name] = {"tensors": len(tensors), "differ": differ, "padded": padded}
    return {"reference_tensors": len(reference),
            "reference_numel": sum(t.numel() for t in reference.values()), "outputs": found}


# Main ---------------------------------------------------------------------------------------
@dataclass
class Row:
    size: int
    """index into SIZES (-1: the import baseline)."""
    tool: str
    runs: List[dict] = field(default_factory=list)
    """one Measure (as a dict) per round."""
    output_bytes: int = 0

    @property
    def wall(self) -> float:
        return min(r["wall_s"] for r in self.runs)

    def top(self, key: str) -> int:
        return max(r[key] for r in self.runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of every tool on every checkpoint; the fastest counts")
    parser.add_argument("--retry-above", type=float, default=0.3,
                        help="run again when other jobs kept more than this many cores busy")
    parser.add_argument("--retries", type=int, default=1, help="at most this many times a run")
    parser.add_argument("--work", type=Path, default=WORK / "convert",
                        help="model JSONs, checkpoints, outputs, logs and results.json")
    parser.add_argument("--fresh", action="store_true", help="train the checkpoints again")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from WORK/results.json without running")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    saved = args.work / "results.json"
    if args.report_only:
        if not saved.exists():
            sys.exit(f"{saved} does not exist: run the bench first")
        data = json.loads(saved.read_text())
    else:
        data = run_bench(args)
        saved.write_text(json.dumps(data, indent=1))
    body = report(data)
    print(body)
    if not args.no_write:
        write_section("convert", body)
    return 0


def run_bench(args) -> dict:
    started = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    paths = prepare_data(WORK / "training")  # bench_training's tokenizer and data, shared
    checkpoints = []
    for index, (label, model) in enumerate(SIZES):
        made = make_checkpoint(paths, index, model, args.work, args.fresh)
        ckpt = args.work / f"ckpt{index}"
        checkpoints.append(dict(made, label=label, model=model,
                                bytes=folder_bytes(ckpt / TAG),
                                files={p.name: p.stat().st_size for p in (ckpt / TAG).iterdir()
                                       if p.is_file()}))
        how = "reused" if made["reused"] else f"trained in {made['train_wall_s']:.0f} s"
        print(f"checkpoint {index}: {label}, {checkpoints[-1]['bytes'] / 1e9:.2f} GB ({how})",
              flush=True)
    os.sync()
    rows = [Row(size=-1, tool=BASELINE[0])] + [
        Row(size=i, tool=name) for i in range(len(SIZES)) for name, _ in TOOLS]
    outs = args.work / "out"
    for round_ in range(args.rounds):
        for row in rows:
            if row.size < 0:
                cmd, out = BASELINE[1], None
            else:
                ckpt = args.work / f"ckpt{row.size}"
                out = outs / f"{row.size}-{TOOLS_BY_NAME[row.tool][0]}"
                cmd = TOOLS_BY_NAME[row.tool][1](str(ckpt), str(out))
            log = args.work / f"run{row.size}-{TOOLS_BY_NAME.get(row.tool, ('base',))[0]}.log"
            for attempt in range(1 + args.retries):
                if out is not None:
                    shutil.rmtree(out, ignore_errors=True)
                    out.parent.mkdir(parents=True, exist_ok=True)
                # the previous outputs' writeback happens here, not inside the next timed run
                os.sync()
                m = measure(cmd, log)
                row.runs.append(asdict(m))
                print(f"round {round_ + 1}, checkpoint {row.size}, {row.tool}: {m.wall_s:.2f} s "
                      f"(others {m.others_cpu:.2f} cores), peak RSS {m.hwm / GIB:.3f} GiB (anon "
                      f"{m.anon / GIB:.3f}, file {m.file / GIB:.3f}); "
                      f"{time.perf_counter() - started:.0f} s so far", flush=True)
                if m.others_cpu <= args.retry_above:
                    break
            if out is not None:
                row.output_bytes = folder_bytes(out)
    checks = []
    for index, (_, model) in enumerate(SIZES):
        names = {name: outs / f"{index}-{TOOLS_BY_NAME[name][0]}" for name, _ in TOOLS}
        checks.append(check_outputs(names, model["vocab_size"]))
        bad = {k: v["differ"] for k, v in checks[-1]["outputs"].items() if v["differ"]}
        print(f"checkpoint {index}: outputs {'agree' if not bad else f'DIFFER: {bad}'}",
              flush=True)
    return {"checkpoints": checkpoints, "rows": [asdict(r) for r in rows], "checks": checks,
            "rounds": args.rounds, "retry_above": args.retry_above, "retries": args.retries,
            "wall_s": time.perf_counter() - started}


def report(data: dict) -> str:
    import torch

    rows = [Row(**r) for r in data["rows"]]
    cks, checks = data["checkpoints"], data["checks"]
    base = rows[0]
    by = {(r.size, r.tool): r for r in rows}
    table = []
    for r in rows[1:]:
        peer = by[r.size, PEERS.get(r.tool, PEER)]
        ratio = "" if not r.tool.startswith("ours") else (
            f"**{r.wall / peer.wall:.2f}** / **{r.top('hwm') / peer.top('hwm'):.2f}** / "
            f"{r.top('anon') / peer.top('anon'):.2f}")
        ck = cks[r.size]
        rounds = " / ".join(f"{x['wall_s']:.2f}" for x in r.runs)
        table.append([f"{_g(ck['bytes'])} ({_params(ck['model'])})", r.tool, f"{r.wall:.2f}",
                      rounds, _g(r.top("hwm")), _g(r.top("anon")), _g(r.top("file")),
                      _g(r.output_bytes), ratio])
    table = markdown_table(
        ["checkpoint (GiB)", "tool", "wall (s)", "runs (s)", "peak RSS (GiB)",
         "RssAnon peak (GiB)", "RssFile peak (GiB)", "output (GiB)",
         "vs DeepSpeed: wall / peak RSS / RssAnon"], table, "llrrrrrrr")
    agree = all(not v["differ"] for c in checks for v in c["outputs"].values())
    padded = sorted({f"{k} ({n} rows)" for c in checks for v in c["outputs"].values()
                     for k, n in v["padded"].items()})
    ck_lines = "; ".join(f"{c['label']}, {_params(c['model'])}: {_g(c['bytes'])} GiB"
                         for c in cks)
    trained = [c for c in cks if not c["reused"]]
    train_note = (" (trained for this run in " + ", ".join(
        f"{c['train_wall_s']:.0f} s" for c in trained) + ")" if trained else
        " (made by an earlier run of the bench, in " + ", ".join(
        f"{c['train_wall_s']:.0f} s" for c in cks) + "; --fresh trains them again)")
    gap = max(abs(x["hwm_sampled"] - x["hwm"]) / x["hwm"] for r in rows for x in r.runs)
    fastest = [min(r.runs, key=lambda x: x["wall_s"]) for r in rows]
    others = max(x["others_cpu"] for x in fastest)
    children = max(x["children"] for r in rows for x in r.runs)
    sizes = range(len(cks))
    fp32 = [by[i, "ours --to fp32"] for i in sizes]
    peer = [by[i, PEER] for i in sizes]
    sharded = [by[i, TOOLS[4][0]] for i in sizes]
    ds_sharded = [by[i, TOOLS[5][0]] for i in sizes]
    masters = [by[i, PEER].output_bytes for i in sizes]  # fp32, padded: the master partitions
    base_file = base.top("hwm") - base.top("anon")  # the libraries' pages at the import's peak

    def spread(values, fmt="{:.2f}"):
        return " / ".join(fmt.format(v) for v in values)

    command = "python bench/bench_convert.py" + (
        f" --rounds {data['rounds']}" if data["rounds"] != 3 else "")
    check_text = (
        f"**The outputs agree**: on every checkpoint, every tensor of ours --to fp32 equals "
        f"(torch.equal, same dtype) the same-named tensor of ours --to hf (read back with "
        f"read_hf_folder, which gives our names), of both DeepSpeed outputs and of the sharded "
        f"ones ({', '.join(str(c['reference_tensors']) for c in checks)} tensors); DeepSpeed "
        f"keeps the padded vocabulary rows of {', '.join(padded)}, which ours trims to "
        f"vocab_size 8100, so their first 8100 rows are compared." if agree else
        "**The outputs DIFFER**: " + "; ".join(
            f"checkpoint {i}, {k}: {v['differ'][:4]}" for i, c in enumerate(checks)
            for k, v in c["outputs"].items() if v["differ"]))
    return _wrap(f"""## checkpoint conversion (ours against DeepSpeed's zero_to_fp32, ZeRO-3)

Command: `{command}` ({data['wall_s'] / 60:.1f} min)
Machine: {machine_line()}, torch {torch.__version__}, DeepSpeed {deepspeed_version()}.
Checkpoints: ZeRO-3, DP=2 (`torchrun --nproc_per_node 2`, gloo), fp32, AdamW, one step with
`--save` (micro batch 1, encoder 64 tokens); vocabulary 8100 padded to 8192, untied, gated-gelu,
d_kv 64; {ck_lines}{train_note}. Almost all of a checkpoint is the two ranks' optimizer files
(fp32 master partitions, exp_avg, exp_avg_sq: 12 bytes a parameter); ZeRO-3's model-states
files hold placeholders. Tools, each its own process on the same iteration folder, output
removed before each run: `convert_checkpoint.py --load CKPT --to fp32 OUT --no-progress` (and
`--to hf`, which also writes the run's tokenizer), `python -m deepspeed.utils.zero_to_fp32 CKPT
OUT --tag iter_0000001` (default: one pytorch_model.bin; and with `--safe_serialization`, the
format ours writes), and both with {SHARD} output shards (`--max-shard-size {SHARD}`,
`--max_shard_size {SHARD}`; the default of both is 5GB). {data['rounds']} rounds (every tool on
every checkpoint, then again); before each run `sync` flushes the earlier runs' outputs, and a
run during which other jobs kept more than {data['retry_above']} cores busy is run once more
("runs" lists them all). The fastest run's wall time counts, the highest memory figures.

**wall**: spawn to exit, interpreter start-up and imports included (`python -c 'import
deepspeed'`, which both tools do: {base.wall:.2f} s, peak RSS {_g(base.top('hwm'))} GiB, RssAnon
{_g(base.top('anon'))} GiB). **peak RSS**: VmHWM at exit (wait4's ru_maxrss; the highest VmHWM
read from /proc every 0.01 s agrees within {100 * gap:.1f}%). It counts both kinds of resident
page: **RssAnon** (private: tensors, the interpreter) and **RssFile** (file pages mapped into the
process: both tools open the checkpoint with `torch.load(mmap=True)`, so the pages they touch
count while mapped, as do the shared libraries). Those two columns are the highest values read
from /proc/PID/status every 0.01 s (the kernel keeps no peak of them; they peak at different
moments, so their sum can exceed VmHWM). File pages belong to the page cache, which can drop
and re-read them under memory pressure: RssAnon is the memory a conversion needs. Every
run read the checkpoint from the page cache (the training run or the runs before had just
written or read it: warm reads); outputs go to the page cache and are flushed later (neither
tool fsyncs). **vs DeepSpeed**: wall / peak RSS /
RssAnon, ours over DeepSpeed's default run on the same checkpoint (the {SHARD}-shard row: over
DeepSpeed's {SHARD}-shard run). Other jobs kept at most
{others:.2f} cores busy during a counted (fastest) run; no tool started a child process
({children} seen).

{chr(10).join(table)}

{check_text}

Reading. Over the three checkpoints ({spread([c['bytes'] / GIB for c in cks])} GiB), ours
--to fp32 takes {spread([r.wall for r in fp32])} s against DeepSpeed's
{spread([r.wall for r in peer])} s ({spread([a.wall / b.wall for a, b in zip(fp32, peer)])}x),
of which about {base.wall:.1f} s is starting Python and importing torch and DeepSpeed. Its peak
RSS is {spread([_g(r.top('hwm')) for r in fp32], '{}')} GiB against DeepSpeed's
{spread([_g(r.top('hwm')) for r in peer], '{}')} GiB
({spread([a.top('hwm') / b.top('hwm') for a, b in zip(fp32, peer)])}x): both grow with the
checkpoint, beyond the import's {_g(base.top('hwm'))} GiB by
{spread([(r.top('hwm') - base.top('hwm')) / c['bytes'] for r, c in zip(fp32, cks)])} of its
size for ours. Neither tool holds the checkpoint: both read only the fp32 master partitions (a
third of an Adam checkpoint; the moments are never touched), and those pages stay mapped until
the process ends: RssFile less the import's {_g(base_file)} GiB of libraries is
{spread([(r.top('file') - base_file) / m for r, m in zip(fp32, masters)])}x the masters' size.
What grows in DeepSpeed's RssAnon is the output: with the default 5GB shard size it assembles
the whole state dict before writing its only file, so its RssAnon is the import's plus the output
plus {spread([_g(r.top('anon') - base.top('anon') - r.output_bytes) for r in peer], '{}')} GiB.
Ours never holds the output: ShardWriter writes each tensor's bytes to its file as the tensor
comes and lets it go, so its RssAnon is the import's plus
{spread([_g(r.top('anon') - base.top('anon')) for r in fp32], '{}')} GiB (the full tensors being
assembled) for outputs of {spread([_g(r.output_bytes) for r in fp32], '{}')} GiB (the peaks
vary from run to run: ours' RssAnon over the runs spans
{spread([_g(r.top('anon') - min(x['anon'] for x in r.runs)) for r in fp32], '{}')} GiB,
DeepSpeed's {spread([_g(r.top('anon') - min(x['anon'] for x in r.runs)) for r in peer], '{}')}
GiB). With {SHARD} shards RssAnon is {spread([_g(r.top('anon')) for r in ds_sharded], '{}')} GiB
for DeepSpeed: the import's, at most one shard and the tensors being assembled, whatever the
checkpoint size; for ours it is {spread([_g(r.top('anon')) for r in sharded], '{}')} GiB, as
with 5GB shards ({spread([_g(r.top('anon')) for r in fp32], '{}')} GiB): the shard size does
not matter to it. The memory of ours --to fp32 is therefore bounded by the tensors being
assembled (and the mapped masters, which the page cache can reclaim), neither by the output nor
by --max-shard-size; with the defaults its peak RSS is
{spread([a.top('hwm') / b.top('hwm') for a, b in zip(fp32, peer)])}x DeepSpeed's.
""")


def _wrap(text: str, width: int = 100) -> str:
    """Fill the report's prose paragraphs to `width`; headings, the Command line and tables
    stay as they are."""
    import textwrap

    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        keep = [line for line in lines if line.startswith(("##", "Command:"))]
        prose = " ".join(line for line in lines if line not in keep)
        if block.startswith("|") or not prose:
            out.append(block)
            continue
        out.append("\n".join(keep + [textwrap.fill(prose, width, break_long_words=False,
                                                     break_on_hyphens=False)]))
    return "\n\n".join(out)


def _g(n: float) -> str:
    return f"{n / GIB:.3f}"


def _params(model: dict) -> str:
    from megatron.model.config import T5Config
    from megatron.model.meta import count_parameters

    return f"{count_parameters(T5Config(**model), 1, 128) / 1e6:.1f} M parameters"


if __name__ == "__main__":
    sys.exit(main())
