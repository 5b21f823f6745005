"""Shared pieces of the benchmarks: inputs from tests/data/corpora, RSS sampling, RESULTS.md."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

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
