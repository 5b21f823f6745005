"""Two-process CPU training under each ZeRO stage: steady-state steps/s, peak memory per rank,
and the `--dry-run` memory estimate against the measured peak.

    python bench/bench_training.py [--steps 12] [--skip 2] [--work DIR] [--no-write]

Data: the shared English corpora (about 3.6 MB), a SentencePiece tokenizer of 8000 pieces
(+100 sentinels) and their .bin/.idx, made once under --work (default bench/work/training).
Model: d_model 512, 8 heads x 64, d_ff 1024 gated-gelu, 4 + 4 layers, untied, vocabulary 8100
(padded to 8192), 31.6 M parameters; encoder 256 / decoder 58 tokens (span corruption), micro
batch 4 per rank, fp32, AdamW. Each configuration is one `torchrun --nproc_per_node 2` run
with gloo, one thread per rank (torchrun's default).

Speed: the mean of rank 0's logged ` step: X s` (--log-interval 1) after the first --skip
steps, and its ratio to ZeRO 0 run by this script just before. ZeRO 0 is run again at the end:
the two ZeRO 0 rows show how far this machine drifted during the bench.

Memory: each rank's VmHWM (the kernel's high-water mark of its resident set) read from
/proc/<pid>/status every 0.1 s while it runs; the mark only rises, so the last read misses at
most the final 0.1 s (interpreter teardown). It is checked against rank 0's own `mem:` field
(getrusage's ru_maxrss). Resident memory includes what the estimate does not model (the
interpreter, torch, DeepSpeed, gloo, the tokenizer, the data): the baseline is the peak of
the same command with a tiny model (d_model 64, 1 + 1 layers, the same vocabulary, batch and
lengths, 3 steps), less the tiny model's own estimate. The estimate comes from
`megatron.training.memory.estimate_memory` called with what the flags resolve to (as
`--dry-run` does, with WORLD_SIZE=2), once as `--dry-run` prints it and once for this run's
host (device_type 'cpu'; attention 'eager', what the model's 'auto' runs on CPU).
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
import threading
import time
from dataclasses import dataclass, field
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
@dataclass
class Run:
    step_s: Dict[int, float] = field(default_factory=dict)
    """iteration -> rank 0's logged step time."""
    logged_mem: float = 0.0
    """rank 0's last `mem:` field (ru_maxrss), bytes."""
    hwm: Dict[int, int] = field(default_factory=dict)
    """rank -> peak resident bytes (VmHWM)."""
    wall_s: float = 0.0


def _vm_hwm(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rank_of(pid: int) -> Optional[int]:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def run_torchrun(flags: Sequence[str], log: Path, env: Optional[Dict[str, str]] = None) -> Run:
    """`torchrun --nproc_per_node 2 -m megatron.pretrain_t5 FLAGS`, its output in `log`; `env`
    is added to the environment."""
    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(29500 + os.getpid() % 1000), "-m", "megatron.pretrain_t5",
           *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    run, ranks = Run(), {}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        launcher = psutil.Process(proc.pid)

        def sample():
            while proc.poll() is None:
                try:
                    children = launcher.children()
                except psutil.NoSuchProcess:
                    break
                for child in children:
                    if child.pid not in ranks:
                        ranks[child.pid] = _rank_of(child.pid)
                    hwm = _vm_hwm(child.pid)
                    rank = ranks[child.pid]
                    if hwm is not None and rank is not None:
                        run.hwm[rank] = max(run.hwm.get(rank, 0), hwm)
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        sampler.join()
    run.wall_s = time.perf_counter() - start
    text = log.read_text()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log}\n"
                 + "\n".join(text.splitlines()[-30:]))
    for match in STEP_RE.finditer(text):
        run.step_s[int(match.group(1))] = float(match.group(3))
        run.logged_mem = float(match.group(2)) * GIB
    if sorted(run.hwm) != [0, 1]:
        sys.exit(f"could not read the peak memory of both ranks (got ranks {sorted(run.hwm)})")
    return run


# The estimate -------------------------------------------------------------------------------
def estimates(flags: Sequence[str]):
    """(as --dry-run prints it, for this host) for `flags`, resolved as for 2 processes."""
    from megatron.arguments import parse_args
    from megatron.training.memory import ZeroBuckets, estimate_memory

    args = parse_args(list(flags), env={"WORLD_SIZE": "2"})
    kw = dict(tensor_parallel_size=args.tensor_model_parallel_size,
              data_parallel_size=args.data_parallel_size, zero_stage=args.zero_stage,
              precision=args.precision, offload_optimizer=args.offload_optimizer,
              offload_param=args.offload_param, micro_batch_size=args.micro_batch_size,
              encoder_seq_length=args.encoder_seq_length,
              decoder_seq_length=args.decoder_seq_length,
              checkpoint_activations=args.checkpoint_activations,
              checkpoint_num_layers=args.checkpoint_num_layers,
              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    dry = estimate_memory(args.model, **kw)  # what pretrain_t5.dry_run passes
    host = estimate_memory(args.model, **kw, attention_kernel="eager",
                           buckets=ZeroBuckets.from_zero_config(
                               args.ds_config["zero_optimization"]))
    return dry, host, args.decoder_seq_length


def model_states(est) -> int:
    return est.parameters + est.gradients + est.optimizer_states + est.buffers + est.offloaded


# Main ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the speed")
    parser.add_argument("--work", type=Path, default=WORK / "training",
                        help="data, model JSONs and the runs' logs")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only configurations whose name contains one of these")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.steps <= args.skip:
        sys.exit("--steps must exceed --skip")
    started = time.perf_counter()
    paths = prepare_data(args.work)

    configs = list(CONFIGS)
    if native_bf16():
        configs.append(BF16)
        bf16_note = "bf16 ZeRO 1 is timed: this CPU has bf16 instructions."
    else:
        bf16_note = ("bf16 ZeRO 1 is not run: this CPU has neither avx512_bf16 nor amx_bf16, so "
                     "torch emulates bf16 GEMMs (tens of times slower than fp32, see the model "
                     "section) and a timing would measure the emulation.")
    configs.append(("ZeRO 0 (again, last)", CONFIGS[0][1]))
    if args.only:
        configs = [c for c in configs if any(o in c[0] for o in args.only)]

    rows, checks, peer = [], [], None
    for i, (name, extra) in enumerate(configs):
        flags = train_flags(paths, "model", args.steps, extra)
        dry, host, dec_len = estimates(flags)
        tiny_flags = train_flags(paths, "tiny", 3, extra)
        _, tiny_host, _ = estimates(tiny_flags)
        big = run_torchrun(flags, args.work / f"run{i}.log")
        tiny = run_torchrun(tiny_flags, args.work / f"run{i}_tiny.log")
        times = [t for it, t in sorted(big.step_s.items()) if it > args.skip]
        if len(times) != args.steps - args.skip:
            sys.exit(f"{name}: expected {args.steps} logged steps, found {len(big.step_s)} "
                     f"(see {args.work / f'run{i}.log'})")
        speed = 1 / statistics.mean(times)
        if name == "ZeRO 0":
            peer = speed
        peak = max(big.hwm.values())
        baseline = max(tiny.hwm.values()) - (tiny_host.total + tiny_host.offloaded)
        measured = peak - baseline
        host_total = host.total + host.offloaded
        row = dict(name=name, speed=speed, spread=(min(times), max(times)), hwm=big.hwm,
                   logged=big.logged_mem, baseline=baseline, measured=measured,
                   dry=dry.total, dry_states=model_states(dry), host=host_total,
                   host_states=model_states(host), wall=big.wall_s + tiny.wall_s)
        rows.append(row)
        print(f"{name}: {speed:.3f} steps/s (steps {min(times):.2f}-{max(times):.2f} s), "
              f"peak rank0 {big.hwm[0] / GIB:.3f} rank1 {big.hwm[1] / GIB:.3f} GiB "
              f"(logged {big.logged_mem / GIB:.2f}), tiny {tiny.hwm[0] / GIB:.3f}/"
              f"{tiny.hwm[1] / GIB:.3f}, baseline {baseline / GIB:.3f}, measured "
              f"{measured / GIB:.3f}, estimate dry-run {dry.total / GIB:.3f} host "
              f"{host_total / GIB:.3f} GiB; {row['wall']:.0f} s", flush=True)
        checks.append(abs(big.logged_mem - big.hwm[0]) / big.hwm[0])
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
