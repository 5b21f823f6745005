"""Shared pieces of the benchmarks: inputs from tests/data/corpora, RSS sampling, RESULTS.md and
its Markdown tables, and the training harness (bench_training's data, model and flags, and
`run_torchrun`, which the training, pipeline, MoE, checkpoint and conversion benches launch
their runs with). A bench imports from here, never from another bench."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench" / "work"
RESULTS = REPO / "bench" / "RESULTS.md"


def corpora_dir() -> Path:
    """The real-text corpora the tests use: $T5_CORPORA_DIR, else tests/data/corpora."""
    path = Path(os.environ.get("T5_CORPORA_DIR") or REPO / "tests" / "data" / "corpora")
    if not path.is_dir():
        sys.exit(f"corpora not found at {path}: set T5_CORPORA_DIR")
    return path


def english_texts() -> List[str]:
    texts = []
    for name in ("en_wikitext2.jsonl", "en_shakespeare.jsonl"):
        with open(corpora_dir() / name, encoding="utf-8") as f:
            texts.extend(json.loads(line)["text"] for line in f)
    return texts


def make_english_jsonl(path: Path, target_mb: float) -> Path:
    """An English JSONL of about `target_mb` MB, made by repeating the English corpora."""
    if path.exists() and abs(path.stat().st_size / 1e6 - target_mb) < 0.05 * target_mb:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in english_texts()]
    size = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while size < target_mb * 1e6:
            for line in lines:
                f.write(line)
                size += len(line.encode("utf-8"))
                if size >= target_mb * 1e6:
                    break
    os.replace(tmp, path)
    return path


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_measured(cmd: Sequence[str], interval: float = 0.05) -> Tuple[float, int, str]:
    """Run `cmd`; return (wall seconds, peak RSS of its process tree in bytes, stderr)."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_bytes(proc.pid))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{err}")
    return wall, peak[0], err


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def write_section(name: str, body: str) -> None:
    """Replace (or add) the section `name` of bench/RESULTS.md."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)


def allocated(fn) -> Dict[str, int]:
    """Bytes allocated and not yet freed during `fn()`, counted from its start: 'peak' (the
    most at any moment), 'held' (at its end) and 'low' (the least: below 0 when `fn` freed
    blocks older than it, which the profiler counts only now and then, so the caller frees
    those before), from torch.profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = low = 0
    for _, nbytes in events:
        live += nbytes
        peak, low = max(peak, live), min(low, live)
    return {"peak": peak, "held": live, "low": low}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                   align: Optional[Sequence[str]] = None) -> List[str]:
    """A Markdown table as lines: the header row, the alignment row (per column 'l' for
    `---`, 'r' for `---:`; default: the first column 'l', the others 'r') and one line per row,
    each cell `str()`-ed as given (format the numbers before); a None cell is left blank
    (`| |`, where '' gives `|  |`)."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"{len(align)} alignments for {len(headers)} columns")
    marks = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join(marks[a] for a in align) + " |"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells for {len(headers)} columns: {row}")
        lines.append("|" + "|".join(" " if cell is None else f" {cell} " for cell in row) + "|")
    return lines


def tokenizer_model(vocab: int) -> Path:
    """A SentencePiece model of `vocab` pieces trained on 4 MB of the English corpora, under
    WORK (made once)."""
    prefix = WORK / f"spm_en_{vocab}"
    if not prefix.with_suffix(".model").exists():
        src = make_english_jsonl(WORK / "en_4mb.jsonl", 4)
        run_measured([sys.executable, str(REPO / "data_tools" / "train_tokenizer.py"), "--input",
                      str(src), "--output-prefix", str(prefix), "--vocab-size", str(vocab),
                      "--character-coverage", "1.0"])
    return prefix.with_suffix(".model")


# The training harness: bench_training's model, data and flags, and one torchrun run ---------
MODEL = dict(vocab_size=8100, d_model=512, d_kv=64, d_ff=1024, num_layers=4,
             num_decoder_layers=4, num_heads=8, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False, dropout_rate=0.0)
TINY = dict(MODEL, d_model=64, d_kv=32, d_ff=128, num_layers=1, num_decoder_layers=1,
            num_heads=2)
CORPORA = ("en_wikitext2.jsonl", "en_shakespeare.jsonl")
MICRO_BATCH, ENC_LEN = 4, 256
GIB = 2 ** 30
SAVE_LINE = re.compile(r"saved checkpoint \S+/iter_(\d+) \(([\d.]+) MiB; the step was held "
                       r"([\d.]+) s(?: \+ ([\d.]+) s waiting for the previous save)?; state "
                       r"taken in ([\d.]+) s; written in ([\d.]+) s per rank")


def saves_in_log(text: str) -> Dict[int, Dict[str, float]]:
    """{iteration: MiB, seconds the step was held, waited for the previous save, taken, written}
    of each `saved checkpoint` line of a trainer's log."""
    return {int(m.group(1)): {"mib": float(m.group(2)), "held_s": float(m.group(3)),
                              "waited_s": float(m.group(4) or 0.0),
                              "capture_s": float(m.group(5)), "written_s": float(m.group(6))}
            for m in SAVE_LINE.finditer(text)}



CONFIGS = [
    ("ZeRO 0", ["--zero-stage", "0"]),
    ("ZeRO 1", ["--zero-stage", "1"]),
    ("ZeRO 2", ["--zero-stage", "2"]),
    ("ZeRO 3", ["--zero-stage", "3"]),
    ("ZeRO 2 + offload optimizer", ["--zero-stage", "2", "--offload-optimizer", "cpu"]),
    ("ZeRO 3 + offload optimizer, params", ["--zero-stage", "3", "--offload-optimizer", "cpu",
                                            "--offload-param", "cpu"]),
]
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
        check_call([sys.executable, str(REPO / "data_tools" / "train_tokenizer.py"), "--input",
                *inputs, "--output-prefix", str(work / "spm"), "--vocab-size", "8000",
                "--character-coverage", "1.0"])
    if not Path(f"{prefix}_text_document.idx").exists():
        check_call([sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input",
                *inputs, "--output-prefix", str(prefix), "--tokenizer-model", str(tokenizer),
                "--append-eod", "--workers", "2", "--no-progress"])
    paths = {"tokenizer": tokenizer, "data": Path(f"{prefix}_text_document")}
    for name, fields in (("model", MODEL), ("tiny", TINY)):
        paths[name] = work / f"{name}.json"
        paths[name].write_text(json.dumps(fields, indent=1) + "\n")
    return paths


def check_call(cmd: Sequence[str]) -> None:
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


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and iowait) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
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
    start, busy, own = time.perf_counter(), busy_seconds(), own_seconds()
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
    run.others_cpu = max(0.0, (busy_seconds() - busy) - (own_seconds() - own)) / run.wall_s
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log}\n"
                 + "".join(lines[-30:]))
    if sorted(run.hwm) != list(range(nproc)):
        sys.exit(f"could not read the peak memory of every rank (got ranks {sorted(run.hwm)})")
    return run


def gib(n: float) -> str:
    return f"{n / GIB:.3f}"


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def model_size() -> str:
    from megatron.model.config import T5Config
    from megatron.model.meta import count_parameters

    return f"{count_parameters(T5Config(**MODEL), 1, 128) / 1e6:.1f} M"
