"""Checkpoint saves: how long a save holds the training loop, synchronous against asynchronous
(--async-save), and the save's write throughput against a plain write of the same bytes.

    python bench/bench_checkpoint.py [--rounds 2] [--work DIR] [--no-write]

Runs (each `torchrun --nproc_per_node 2`, gloo, CPU, fp32, ZeRO-1, micro batch 1, encoder 64
tokens, 6 steps; bench_training's data and tokenizer): a model of 78.6 M parameters (d_model
768, d_ff 2048 gated-gelu, 4 + 4 layers, vocabulary 8100 padded to 8192) whose checkpoint with
Adam's states is 1.26 GB (the weights in the model file, the fp32 masters and both moments in
the two ranks' optimizer files). Saves at steps 2, 4 and 6 (--save-interval 2), synchronous
and asynchronous, and a run without saves for the step time.

Measures, from the trainer's own log lines: per committed save, its bytes, how long it held
the step (`the step was held B s`, plus `W s waiting for the previous save` when the next save
found the last one still being written), and the writing time per rank; per step, rank 0's step
time (with --async-save the writer thread competes with the steps that follow a save). The
final save (step 6) is waited for before the run ends; the figure per save is the mean over
the saves at steps 2 and 4. Plain write: two processes each write half the checkpoint's bytes
to a file in the same folder, in 64 MiB blocks, then fsync: its MB/s is the disk's, which the
save's `written` time is compared with. The fastest of --rounds rounds counts. Results go to
bench/RESULTS.md (section "checkpoint").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    WORK,
    machine_line,
    markdown_table,
    prepare_data,
    run_torchrun,
    saves_in_log,
    train_flags,
    write_section,
)

MODEL = dict(vocab_size=8100, d_model=768, d_kv=64, d_ff=2048, num_layers=4,
             num_decoder_layers=4, num_heads=12, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False, dropout_rate=0.0)
STEP_RE = re.compile(r" iteration\s+(\d+)/.*\| step: ([\d.]+) s")
MIB = 2 ** 20


def run(paths, work: Path, name: str, extra: List[str]) -> Dict:
    ckpt = work / f"ckpt_{name}"
    shutil.rmtree(ckpt, ignore_errors=True)
    flags = train_flags(paths, "bench", 6, ["--zero-stage", "1", "--micro-batch-size", "1",
                                            "--encoder-seq-length", "64", *extra])
    if extra:
        flags += ["--save", str(ckpt)]
    log = work / f"{name}.log"
    result = run_torchrun(flags, log)
    text = log.read_text()
    saves = saves_in_log(text)
    steps = {int(m.group(1)): float(m.group(2)) for m in STEP_RE.finditer(text)}
    if extra and sorted(saves) != [2, 4, 6]:
        sys.exit(f"{name}: expected saves at 2, 4, 6 in {log}, found {sorted(saves)}")
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"saves": saves, "steps": steps, "wall_s": result.wall_s,
            "others_cpu": result.others_cpu}


def plain_write(work: Path, total: int) -> float:
    """Seconds for two processes to write total/2 bytes each (64 MiB blocks, fsync)."""
    code = ("import os, sys, time\n"
            "path, n = sys.argv[1], int(sys.argv[2]); block = os.urandom(64 << 20)\n"
            "with open(path, 'wb') as f:\n"
            "    left = n\n"
            "    while left > 0:\n"
            "        left -= f.write(block[:min(left, len(block))])\n"
            "    f.flush(); os.fsync(f.fileno())\n")
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(work / f"plain{r}.bin"),
                               str(total // 2)]) for r in range(2)]
    if any(p.wait() != 0 for p in procs):
        sys.exit("the plain write failed")
    seconds = time.perf_counter() - start
    for r in range(2):
        (work / f"plain{r}.bin").unlink()
    return seconds


def crc_cost(work: Path) -> Dict[str, float]:
    """Seconds to torch.save (and fsync) 600 MB of fp32 tensors in one process, with and
    without the zip records' CRC-32s (our writer leaves them out), the best of 3 each."""
    import torch

    from megatron.checkpoint.io.async_save import write_file

    state = {f"t{i}": torch.randn(10_000_000) for i in range(15)}
    out = {}
    for crc in (True, False):
        best = float("inf")
        for _ in range(3):
            subprocess.run(["sync"], check=False)
            start = time.perf_counter()
            with open(work / "crc.pt", "wb") as f:
                torch.serialization.set_crc32_options(crc)
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            best = min(best, time.perf_counter() - start)
        out["with" if crc else "without"] = best
    write_file(str(work / "crc.pt"), {"x": torch.zeros(1)})  # leaves the option as ours sets it
    (work / "crc.pt").unlink()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=WORK / "checkpoint")
    parser.add_argument("--no-write", action="store_true", help="print, do not edit RESULTS.md")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    paths = prepare_data(WORK / "training")
    paths["bench"] = args.work / "model.json"
    paths["bench"].write_text(json.dumps(MODEL, indent=1) + "\n")
    rounds: Dict[str, List[Dict]] = {"none": [], "sync": [], "async": [], "plain": []}
    for _ in range(args.rounds):
        rounds["none"].append(run(paths, args.work, "none", []))
        rounds["sync"].append(run(paths, args.work, "sync", ["--save-interval", "2"]))
        rounds["async"].append(run(paths, args.work, "async", ["--save-interval", "2",
                                                               "--async-save"]))
        total = int(rounds["sync"][-1]["saves"][2]["mib"] * MIB)
        rounds["plain"].append({"seconds": plain_write(args.work, total), "bytes": total})
    data = {"rounds": rounds, "crc": crc_cost(args.work), "wall_s": time.perf_counter() - began}
    (args.work / "results.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    print(text)
    if not args.no_write:
        write_section("checkpoint", text)
    return 0


def _held(r: Dict) -> float:
    return statistics.mean(r["saves"][i]["held_s"] + r["saves"][i]["waited_s"] for i in (2, 4))


def report(data: Dict) -> str:
    rounds = data["rounds"]
    sync = min(rounds["sync"], key=_held)
    asyn = min(rounds["async"], key=_held)
    none = min(rounds["none"], key=lambda r: statistics.mean(r["steps"][i] for i in (3, 5)))
    plain = min(rounds["plain"], key=lambda r: r["seconds"])
    mib = sync["saves"][2]["mib"]
    plain_mbs = plain["bytes"] / MIB / plain["seconds"]
    rows = []
    for name, r in (("synchronous", sync), ("--async-save", asyn)):
        for i in (2, 4, 6):
            s = r["saves"][i]
            rows.append([name, i, f"{s['mib']:.0f}", f"{s['held_s']:.3f}",
                         f"{s['waited_s']:.3f}", f"{s['capture_s']:.3f}",
                         f"{s['written_s']:.2f}", f"{s['mib'] / s['written_s']:.0f}",
                         f"{r['steps'].get(i + 1, 0):.3f}"])
    ratio = _held(asyn) / _held(sync)
    step_none = statistics.mean(none["steps"][i] for i in (3, 5))
    step_async = statistics.mean(asyn["steps"][i] for i in (3, 5))
    return "\n".join([
        "## checkpoint (saves: synchronous against --async-save, 2 processes on CPU)",
        "",
        f"Command: `python bench/bench_checkpoint.py` ({data['wall_s'] / 60:.1f} min)",
        f"Machine: {machine_line()}.",
        "Model: 78.6 M parameters (d_model 768, d_ff 2048 gated-gelu, 4 + 4 layers, vocabulary "
        "8100 padded to 8192), fp32, ZeRO-1, `torchrun --nproc_per_node 2` (gloo), micro batch 1, "
        f"encoder 64 tokens; a checkpoint with Adam's states is {mib:.0f} MiB. Saves at steps 2, "
        "4, 6; the fastest of the rounds counts. From the trainer's log lines: held = how long "
        "the save held the training loop; waited = the part of it spent waiting for the "
        "previous asynchronous save; state taken = DeepSpeed's state dicts captured (views "
        "cloned; with --async-save every tensor copied); written = the time each rank spent "
        "writing its files "
        "(in the background with --async-save), fsync included; next step = rank 0's time "
        "for the step after the save.",
        "",
        *markdown_table(["saves", "step", "MiB", "held (s)", "waited (s)", "state taken (s)",
                         "written (s per rank)", "MiB/s", "next step (s)"], rows),
        "",
        f"Held per save (mean of the saves at steps 2 and 4): synchronous {_held(sync):.3f} s, "
        f"asynchronous {_held(asyn):.3f} s: **{ratio:.1%}** of synchronous (goal: at most 10%). "
        f"Plain write of the same {mib:.0f} MiB by two processes (64 MiB blocks, fsync): "
        f"{plain['seconds']:.2f} s, {plain_mbs:.0f} MiB/s; the synchronous save writes at "
        f"{mib / sync['saves'][2]['written_s']:.0f} MiB/s "
        f"({mib / sync['saves'][2]['written_s'] / plain_mbs:.2f}x the plain write). The "
        f"files are written without the zip records' CRC-32s: torch.save of 600 MB (one "
        f"process, fsync) takes {data['crc']['with']:.2f} s with them and "
        f"{data['crc']['without']:.2f} s without. Step "
        f"time after a save: {step_async:.3f} s with --async-save (the writer thread "
        f"competing), {step_none:.3f} s in the run without saves. Whole runs (6 steps, start-up "
        f"included): {none['wall_s']:.1f} s without saves, {sync['wall_s']:.1f} s synchronous, "
        f"{asyn['wall_s']:.1f} s asynchronous. This machine has 2 cores for 2 ranks, so the "
        f"writer thread takes its core from a rank: the step is held {ratio:.0%} as long, but "
        f"the steps that follow slow down by about as much as the write takes. A GPU node's "
        f"host cores are mostly idle while the GPUs compute, which is where the writing in the "
        f"background is free.",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
