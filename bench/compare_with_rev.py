"""After a refactor: checkpoints written by an older revision resume exactly with this tree, and
the conversion tool writes the same bytes.

    python bench/compare_with_rev.py REV [--work DIR]

A git worktree of REV (the C++ helpers copied from this tree) trains a tiny model for 3 of 6
iterations and saves (`--exit-interval 3`); this tree `--load`s that checkpoint and trains to 6;
REV's uninterrupted 6-iteration run is the reference. Compared, per layout (DP 2, PP 2, ZeRO-3,
MoE with EP 2): the log lines of iterations 4-6 without their timings (loss, grad norm, lr,
MoE per-layer numbers) and the validation lines. Then REV's and this tree's
`convert_checkpoint.py` convert the same checkpoints (to hf, fp32, TP 2, PP 1, MoE fp32, EP 1):
every output file's sha256 (meta.json's `saved_at`, and its typed `checkpoint` section, which
older revisions do not write, left out) and the printed text. Last, the
text `--dry-run` (3D dense, MoE, ZeRO-3 with offload) and `python -m megatron.plan` print in both
trees. Prints one line per check; exits 1 if any differs. Needs git, 2 CPU ranks; a few minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, WORK, prepare_data  # noqa: E402

LAYOUTS = {"dp2": [], "pp2": ["--pipeline-model-parallel-size", "2"],
           "z3": ["--zero-stage", "3"],
           "moe": ["--num-experts", "4", "--expert-model-parallel-size", "2"]}
CONVERSIONS = [("hf", "dp2", ["hf"], True), ("fp32", "z3", ["fp32"], False),
               ("tp2", "dp2", ["megatron", "--target-tensor-parallel-size", "2"], False),
               ("pp1", "pp2", ["megatron", "--target-pipeline-parallel-size", "1"], False),
               ("moe-fp32", "moe", ["fp32"], False),
               ("moe-ep1", "moe", ["megatron", "--target-expert-parallel-size", "1"], False)]
DRY = ["--encoder-seq-length", "512", "--decoder-seq-length", "114", "--train-iters", "100",
       "--lr", "1e-4"]
PRINTED = [  # (name, WORLD_SIZE, argv after `python -m`); the paths come from prepare_data
    ("dry-run 3d", "64", ["megatron.pretrain_t5", "--dry-run", "--model-config", "t5-11b",
                          *DRY, "--micro-batch-size", "4", "--global-batch-size", "2048",
                          "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size",
                          "4", "--zero-stage", "1", "--bf16", "--dry-run-device", "cuda"]),
    ("dry-run moe", "16", ["megatron.pretrain_t5", "--dry-run", "--model-config", "TINY",
                           "--num-experts", "8", "--expert-model-parallel-size", "4", *DRY,
                           "--micro-batch-size", "4", "--global-batch-size", "64",
                           "--zero-stage", "2"]),
    ("dry-run offload", "8", ["megatron.pretrain_t5", "--dry-run", "--model-config", "t5-3b",
                              *DRY, "--micro-batch-size", "8", "--global-batch-size", "256",
                              "--zero-stage", "3", "--offload-optimizer", "cpu", "--bf16",
                              "--dry-run-device", "cuda"]),
    ("planner", "1", ["megatron.plan", "--model-config", "t5-11b", *DRY[:4],
                      "--global-batch-size", "2048", "--nodes", "8", "--gpus-per-node", "8",
                      "--gpu", "H100-80GB", "--top", "3"]),
]
COMPARED = re.compile(r"^ (iteration +[456]/|moe per layer at iteration [456]|"
                      r"(validation|test) loss at iteration [456]\b)")


def run(tree: Path, argv: List[str], log: Path, **env_added: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", **env_added)
    with open(log, "w") as out:  # cwd: -m puts it first on sys.path
        proc = subprocess.run(argv, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(argv)}; see {log}")


def train(tree: Path, paths: Dict[str, Path], out: Path, iters_flags: List[str]) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(20000 + os.getpid() % 20000), "-m", "megatron.pretrain_t5",
            "--model-config", str(paths["tiny"]), "--tokenizer-model", str(paths["tokenizer"]),
            "--data-path", str(paths["data"]), "--split", "90,5,5",
            "--data-cache-path", str(out / "cache"), "--num-workers", "0",
            "--encoder-seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "6", "--lr", "3e-3", "--lr-warmup-iters", "1", "--seed", "7",
            "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
            "--log-file", str(out / "log.txt"), *iters_flags]
    out.mkdir(parents=True, exist_ok=True)
    run(tree, argv, out / "stdout.txt")


def compared_lines(log: Path) -> List[str]:
    lines = [line for line in log.read_text().splitlines() if COMPARED.match(line)]
    return [re.sub(r"\| tokens/s.*\| step: [0-9.]+ s", "", line) for line in lines]


def digests(folder: Path) -> Dict[str, str]:
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "meta.json":
            data = re.sub(rb'\n *"saved_at": [^\n]*', b"", data)
            # the typed section a revision after d75d977 adds (formats/meta.py CheckpointKind)
            data = re.sub(rb'\n "checkpoint": \{[^{}]*\},', b"", data)
        out[str(path.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return out


def compare_printed(old: Path, paths: Dict[str, Path], work: Path) -> bool:
    """--dry-run's and the planner's text, old tree against this one."""
    same = True
    for name, world, argv in PRINTED:
        argv = [str(paths["tiny"]) if a == "TINY" else a for a in argv]
        if argv[0] == "megatron.pretrain_t5":
            argv += ["--data-path", str(paths["data"]), "--tokenizer-model",
                     str(paths["tokenizer"])]
        texts = []
        for label, tree in (("old", old), ("new", REPO)):
            log = work / f"{name.replace(' ', '-')}-{label}.txt"
            run(tree, [sys.executable, "-m", *argv], log, WORLD_SIZE=world)
            texts.append([line for line in log.read_text().splitlines()
                          if "real_accelerator" not in line])
        ok = bool(texts[1]) and texts[0] == texts[1]
        same &= ok
        print(f"{name}: {len(texts[1])} printed lines {'identical' if ok else 'DIFFER'}")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the older revision (a commit, tag or branch)")
    parser.add_argument("--work", type=Path, default=WORK / "compare_with_rev")
    args = parser.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    old = work / "old-tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(old), args.rev], cwd=REPO,
                   check=True, capture_output=True)
    try:
        for built in list(REPO.glob("megatron/**/_*helpers*.so")):
            shutil.copy2(built, old / built.relative_to(REPO))
        (old / "megatron" / "data" / "__init__.py").touch()  # a namespace package before
        paths = prepare_data(WORK)
        same = True
        for name, flags in LAYOUTS.items():
            ckpt = work / f"{name}-ckpt"
            train(old, paths, work / f"{name}-ref", flags)
            train(old, paths, work / f"{name}-old", [*flags, "--save", str(ckpt),
                                                     "--exit-interval", "3"])
            train(REPO, paths, work / f"{name}-new", [*flags, "--load", str(ckpt)])
            ref = compared_lines(work / f"{name}-ref" / "log.txt")
            new = compared_lines(work / f"{name}-new" / "log.txt")
            ok = bool(ref) and ref == new
            same &= ok
            print(f"resume {name}: {len(new)} log lines {'identical' if ok else 'DIFFER'}")
        for name, source, target, tokenizer in CONVERSIONS:
            outputs = {}
            for label, tree in (("old", old), ("new", REPO)):
                out = work / f"convert-{name}-{label}"
                argv = [sys.executable, str(tree / "data_tools" / "convert_checkpoint.py"),
                        "--load", str(work / f"{source}-ckpt"), "--no-progress", "--to",
                        target[0], str(out), *target[1:]]
                if tokenizer:
                    argv += ["--tokenizer-model", str(paths["tokenizer"])]
                run(tree, argv, work / f"convert-{name}-{label}.txt")
                text = (work / f"convert-{name}-{label}.txt").read_text().replace(str(out), "OUT")
                text = "\n".join(line for line in text.splitlines()
                                 if "real_accelerator" not in line)
                outputs[label] = (digests(out), text)
            ok = outputs["old"] == outputs["new"] and bool(outputs["new"][0])
            same &= ok
            print(f"convert {name}: {len(outputs['new'][0])} files and the printed text "
                  f"{'identical' if ok else 'DIFFER'}")
        same &= compare_printed(old, paths, work)
        return 0 if same else 1
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO,
                       capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
