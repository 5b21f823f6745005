"""Preprocessing split over tasks: which bytes of the input each shard reads, which shard this
process is, what its files are called, and how its chunks of lines are read.

The input (the files `--input` names, in their sorted order) is one stream of lines. `shard_plan`
cuts that stream into N contiguous parts of about equal bytes: at a file boundary where one is
close (whole files), otherwise inside an uncompressed file just after a newline. A compressed
file cannot be entered in the middle, so it always goes whole to one shard. The shards in index
order therefore hold exactly the lines, hence the documents, of one process's run, in its order.

Shard I of N writes `PREFIX-{I:05d}-of-{N:05d}_{key}_{level}.{bin,idx,meta.json}`
(`shard_prefix`); the manifest that lists a complete set is megatron/data/preprocess/manifest.py.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Iterator, List, Mapping, Optional, Sequence

from megatron.data.preprocess.jsonl import Chunk, read_ranges

# A cut is not moved to a file boundary farther than this share of one shard's bytes: within it,
# whole files balance well enough, and a file is read from its start (no line count to find).
SNAP_FRACTION = 0.05
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".lzma", ".z", ".br")
_SCAN_BYTES = 1 << 16


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of input file `file_index` (`path`); start is 0 or just after a
    newline, end is the file's size or just after a newline."""

    file_index: int
    path: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def is_compressed(path: str) -> bool:
    return str(path).lower().endswith(COMPRESSED_SUFFIXES)


def shard_prefix(prefix: str, index: int, count: int) -> str:
    """The output prefix of shard `index` of `count`: PREFIX-00003-of-00032."""
    return f"{prefix}-{index:05d}-of-{count:05d}"


def _next_line_start(path: str, offset: int, size: int) -> int:
    """The first position >= `offset` at which a line starts (0, or just after a newline), or
    `size` if no line starts there or later."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        pos = offset - 1
        while pos < size:
            block = f.read(_SCAN_BYTES)
            if not block:
                break
            newline = block.find(b"\n")
            if newline >= 0:
                return pos + newline + 1
            pos += len(block)
    return size


def shard_plan(paths: Sequence[str], num_shards: int,
               sizes: Optional[Sequence[int]] = None) -> List[List[Piece]]:
    """The pieces of input each of `num_shards` shards reads, balanced by bytes.

    Cut k (k = 1..N-1) aims at k/N of the total bytes. It moves to the nearest file boundary
    when that is within SNAP_FRACTION of a shard's share, or when the file it falls in is
    compressed; otherwise it moves forward to the next line start in that file. A shard may be
    empty (fewer, larger compressed files than shards).

    Args:
        paths: the input files in input order.
        num_shards: N >= 1.
        sizes: the files' sizes (default: from the file system).
    Raises:
        ValueError: num_shards < 1.
    """
    if num_shards < 1:
        raise ValueError(f"--num-shards {num_shards}: must be at least 1")
    sizes = [os.path.getsize(p) for p in paths] if sizes is None else list(sizes)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    total = starts[-1]
    share = total / num_shards
    cuts = [0]
    for k in range(1, num_shards):
        target = (k * total) // num_shards
        cut = _cut_near(paths, sizes, starts, target, share)
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    plan: List[List[Piece]] = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        pieces = []
        i = bisect.bisect_right(starts, lo) - 1  # the file holding byte lo (bisect: 1,000s of
        while i < len(paths) and starts[i] < hi:  # shards over 10,000s of files stay fast)
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a < b:
                pieces.append(Piece(i, paths[i], a - starts[i], b - starts[i]))
            i += 1
        plan.append(pieces)
    return plan


def _cut_near(paths, sizes, starts, target: int, share: float) -> int:
    """Where the cut aimed at global byte `target` goes (see shard_plan)."""
    i = bisect.bisect_right(starts, target) - 1  # starts[i] <= target < starts[i + 1]
    if i >= len(sizes):
        return starts[-1]
    lo, hi = starts[i], starts[i + 1]
    nearest = lo if target - lo <= hi - target else hi
    if abs(target - nearest) <= SNAP_FRACTION * share or is_compressed(paths[i]):
        return nearest
    return lo + _next_line_start(paths[i], target - lo, sizes[i])


def _lines_before(path: str, offset: int) -> int:
    """How many newlines the first `offset` bytes of `path` hold (for the line numbers of a
    piece that starts mid-file; read at disk speed, far faster than tokenizing the piece)."""
    count = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            left -= len(block)
    return count


def read_piece_chunks(pieces: Sequence[Piece], chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    """The lines of `pieces` in chunks of about `chunk_bytes` (whole lines only), as
    jsonl.read_chunks yields them for whole files: `file_index` is the piece's, line numbers
    count from the file's first line, a BOM is removed only at a file's start."""
    return read_ranges(((piece.file_index, piece.path, piece.start, piece.end,
                         1 + (_lines_before(piece.path, piece.start) if piece.start else 0))
                        for piece in pieces), chunk_bytes)


# ---------------------------------------------------------------------------------------------
# Which shard this process is.


@dataclass(frozen=True)
class ShardChoice:
    index: int
    count: int
    source: str  # where the numbers came from, for the log line

    def describe(self) -> str:
        return f"shard {self.index} of {self.count} (from {self.source})"


class ShardFlagError(ValueError):
    """A shard flag or Slurm variable that cannot be used; str() names it."""


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ShardFlagError(f"{name}={value!r} is not an integer") from None


def shard_from_env(num_shards: Optional[int], shard_index: Optional[int],
                   env: Mapping[str, str]) -> Optional[ShardChoice]:
    """Which shard this process writes, or None for an ordinary (unsharded) run.

    The flags win. Without them: a Slurm array task (SLURM_ARRAY_TASK_ID, counted from
    SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP, of SLURM_ARRAY_TASK_COUNT: `--array
    1-8` is shards 0..7 of 8), else a task of an `srun -n N` step (SLURM_PROCID of
    SLURM_STEP_NUM_TASKS or SLURM_NTASKS; only inside a step, SLURM_STEP_ID set, since a batch
    script sees its allocation's SLURM_NTASKS while running once); both (`srun -n K` in each of
    M array tasks): shard array_index * K + SLURM_PROCID of M * K. A count of 1 from the
    environment is an ordinary run.

    Raises:
        ShardFlagError: one flag without the other outside Slurm, an index outside 0..N-1, N < 1,
            an array whose task ids are not evenly spaced.
    """
    if num_shards is not None or shard_index is not None:
        if num_shards is not None and num_shards < 1:
            raise ShardFlagError(f"--num-shards {num_shards}: must be at least 1")
        if num_shards is None or shard_index is None:
            inherited = _from_slurm(env)
            if inherited is None:
                given, missing = (("--num-shards", "--shard-index") if shard_index is None
                                  else ("--shard-index", "--num-shards"))
                raise ShardFlagError(f"{given} needs {missing} (or a Slurm array or srun step "
                                     "to take it from)")
            if num_shards is None:
                num_shards, source = inherited.count, f"--shard-index and {inherited.source}"
            else:
                shard_index, source = inherited.index, f"--num-shards and {inherited.source}"
        else:
            source = "--num-shards/--shard-index"
        if not 0 <= shard_index < num_shards:
            raise ShardFlagError(f"--shard-index {shard_index}: must be in 0..{num_shards - 1} "
                                 f"(--num-shards {num_shards})")
        return ShardChoice(shard_index, num_shards, source)
    choice = _from_slurm(env)
    if choice is None or choice.count == 1:
        return None
    return choice


def _from_slurm(env: Mapping[str, str]) -> Optional[ShardChoice]:
    array = _from_array(env)
    step = _from_step(env)
    if array is not None and step is not None and step.count > 1:
        # srun -n K inside each task of an array of M: K x M shards, an array task's K together
        return ShardChoice(array.index * step.count + step.index, array.count * step.count,
                           "SLURM_ARRAY_TASK_ID and SLURM_PROCID")
    return array if array is not None else step


def _from_array(env: Mapping[str, str]) -> Optional[ShardChoice]:
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is None:
        return None
    count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    low = _env_int(env, "SLURM_ARRAY_TASK_MIN") or 0
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP") or 1
    if count is None:
        raise ShardFlagError("SLURM_ARRAY_TASK_ID is set without SLURM_ARRAY_TASK_COUNT; "
                             "give --num-shards and --shard-index")
    index, rest = divmod(task - low, step)
    if rest or not 0 <= index < count:
        raise ShardFlagError(
            f"SLURM_ARRAY_TASK_ID={task} is not task k of a regular --array "
            f"(min {low}, step {step}, count {count}); submit --array=0-{count - 1} or give "
            "--num-shards and --shard-index")
    return ShardChoice(index, count, "SLURM_ARRAY_TASK_ID")


def _from_step(env: Mapping[str, str]) -> Optional[ShardChoice]:
    # Only inside an srun step (SLURM_STEP_ID set): the batch script itself also sees
    # SLURM_PROCID=0 and its allocation's SLURM_NTASKS (checked under a real Slurm).
    if env.get("SLURM_STEP_ID") is None or env.get("SLURM_PROCID") is None:
        return None
    count = _env_int(env, "SLURM_STEP_NUM_TASKS") or _env_int(env, "SLURM_NTASKS")
    index = _env_int(env, "SLURM_PROCID")
    if count is None or index is None:
        return None
    if not 0 <= index < count:
        raise ShardFlagError(f"SLURM_PROCID={index} is not below the step's {count} tasks")
    return ShardChoice(index, count, "SLURM_PROCID")


def progress_starts(pieces: Sequence[Piece], num_files: int) -> List[int]:
    """Per input file, the value that added to a chunk's `end_offset` gives how far into this
    shard's bytes reading has got (each file appears in at most one piece of a shard)."""
    starts = [0] * num_files
    done = 0
    for piece in pieces:
        starts[piece.file_index] = done - piece.start
        done += piece.nbytes
    return starts

