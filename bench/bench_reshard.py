"""`--load` at another layout (megatron/checkpoint/io/reshard.py) against the offline route.

    python bench/bench_reshard.py [--repeats 2]

bench_training's model (d_model 512, 4 + 4 layers, about 30M parameters) trains 2 steps on 2 CPU
ranks at TP 2 and saves (weights and Adam states). Then, to resume at TP 1 x DP 2 (ZeRO 1) for
one more step:

- offline: `convert_checkpoint.py --to megatron OUT --target-tensor-parallel-size 1`, then
  `--load OUT` (the conversion's time and peak RSS, and the run's);
- direct: `--load` of the TP 2 checkpoint itself.

Wall time and the peak resident memory of each command's process tree (both ranks together,
sampled every 50 ms), the best of `--repeats`. Both resumed runs include the start and one step, so
their difference is the load. Writes the "reshard" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (GIB, REPO, WORK, machine_line, markdown_table,  # noqa: E402
                          prepare_data, run_measured, train_flags, write_section)


def torchrun(flags: List[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "-m", "megatron.pretrain_t5", *flags]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=WORK / "reshard")
    args = parser.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    paths = prepare_data(WORK)
    saved, converted = work / "tp2", work / "tp1_converted"
    run_measured(torchrun(train_flags(paths, "model", 3, [
        "--tensor-model-parallel-size", "2", "--save", str(saved), "--exit-interval", "2"])))
    resume = train_flags(paths, "model", 3, ["--zero-stage", "1"])
    best = {}
    for _ in range(args.repeats):
        shutil.rmtree(converted, ignore_errors=True)
        rows = {
            "offline: convert_checkpoint.py --to megatron (TP 1)": run_measured(
                [sys.executable, str(REPO / "data_tools" / "convert_checkpoint.py"), "--load",
                 str(saved), "--to", "megatron", str(converted),
                 "--target-tensor-parallel-size", "1", "--no-progress"]),
            "offline: then --load the converted folder, 1 step": run_measured(
                torchrun([*resume, "--load", str(converted)])),
            "direct: --load the TP 2 checkpoint, 1 step": run_measured(
                torchrun([*resume, "--load", str(saved)])),
        }
        for name, (wall, peak, _) in rows.items():
            old = best.get(name)
            best[name] = (min(wall, old[0]) if old else wall, min(peak, old[1]) if old else peak)
    names = list(best)
    offline_s = best[names[0]][0] + best[names[1]][0]
    direct_s, direct_peak = best[names[2]]
    table = "\n".join(markdown_table(["command", "wall s", "peak RSS GiB (both ranks)"],
                           [[n, f"{w:.1f}", f"{p / GIB:.2f}"] for n, (w, p) in best.items()]))
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    body = (f"## reshard (--load at another layout against convert_checkpoint.py then --load)\n\n"
            f"{machine_line()}. `python bench/bench_reshard.py --repeats {args.repeats}` "
            f"(best of {args.repeats}). A TP 2 checkpoint of bench_training's model "
            f"({size / 2 ** 20:.0f} MiB with the Adam states) resumed at TP 1 x DP 2, ZeRO 1, for "
            f"one step.\n\n{table}\n\n"
            f"Direct load and step: {direct_s:.1f} s against {offline_s:.1f} s for the offline "
            f"route ({offline_s / direct_s:.2f}x); peak RSS {direct_peak / GIB:.2f} GiB against "
            f"{best[names[1]][1] / GIB:.2f} GiB for the run from the converted folder "
            f"({direct_peak / best[names[1]][1]:.2f}x), and no copy on disk.\n")
    write_section("reshard", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
