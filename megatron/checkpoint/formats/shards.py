"""safetensors files written as the tensors come: one tensor's bytes in memory at a time.

    PREFIX.safetensors          when everything fits in one shard of `max_bytes`, else
    PREFIX-0000K-of-0000N.safetensors + PREFIX.safetensors.index.json

as transformers names them (PREFIX "model"); other prefixes let more than one set of tensors
(e.g. optimizer moments) share a folder.

A safetensors file is an 8-byte little-endian length N, N bytes of JSON header (per tensor its
dtype, shape and [begin, end) offsets into the data; "__metadata__") and the data block, the
tensors back to back: readers accept no gap between them. The header comes first but is known
only once the shard is complete, and the tensors must not wait in memory until then, so:

- Each shard file starts with `reserve` bytes kept for the header, each tensor's bytes are
  written behind it as `add` is called and the tensor is let go. At the end the header is
  written into that space, padded with spaces (JSON allows trailing whitespace; safetensors pads
  its own header so, to a multiple of 8).
- torch views a mapped tensor only at an offset that is a multiple of its element size, so the
  data block starts at a multiple of 8 and the tensors are ordered by element size, largest
  first (as safetensors orders them). Tensors of the shard's first element size go into the
  file; any other size goes to a side file of its own, copied in behind at the end.
- When that cannot work (the header outgrew its space, or a side file holds a larger element
  size than the file), or would waste more padding than there is data (small shards), the shard
  is rewritten as the exact header followed by its data. Copies are done by the kernel
  (os.copy_file_range) or through a bounded buffer, never by holding a shard; a shard whose
  header did not fit makes the next ones reserve twice what it needed.

Every file is written as `*.partial` and renamed at `close`, so a failure leaves no file under a
final name (the callers write into a staged OUT.tmp that is then removed).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Set, Tuple, Union

import numpy as np
import torch

# Every dtype safetensors stores, under its header name.
DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
# Header space kept at the start of a shard: max_bytes / RESERVE_PER (about 610 KB for the
# default 5 GB: some 4000 tensor entries), within these bounds.
RESERVE_PER, MIN_RESERVE, MAX_RESERVE = 8192, 64 << 10, 16 << 20
COPY_CHUNK = 8 << 20  # bytes read at a time where the kernel cannot copy
METADATA = {"format": "pt"}  # what transformers checks before loading a file


def _align8(n: int) -> int:
    return -(-n // 8) * 8


def _write_at(file: BinaryIO, data: Union[bytes, np.ndarray], offset: int) -> None:
    """All of `data` at `offset`: one pwrite moves at most about 2 GiB on Linux."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(file.fileno(), view, offset)
        view, offset = view[done:], offset + done


def _copy(src: BinaryIO, src_offset: int, count: int, dst: BinaryIO, dst_offset: int) -> None:
    """`count` bytes of `src` from `src_offset` to `dst` at `dst_offset`: by the kernel where the
    file system lets it (no bytes through this process), else through a COPY_CHUNK buffer."""
    try:
        while count:
            done = os.copy_file_range(src.fileno(), dst.fileno(), count, src_offset, dst_offset)
            if not done:
                raise OSError(errno.EIO, f"{src.name}: {count} bytes short")
            count, src_offset, dst_offset = count - done, src_offset + done, dst_offset + done
    except AttributeError:  # not Linux
        pass
    except OSError as err:  # a file system or kernel that does not copy between these files
        if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while count:
        data = os.pread(src.fileno(), min(count, COPY_CHUNK), src_offset)
        if not data:
            raise OSError(errno.EIO, f"{src.name}: {count} bytes short")
        _write_at(dst, data, dst_offset)
        done = len(data)
        count, src_offset, dst_offset = count - done, src_offset + done, dst_offset + done


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of `tensor` in safetensors' order (row-major, little-endian): a view of its
    memory when it is a contiguous CPU tensor, else of one copy."""
    tensor = tensor.detach().to("cpu").resolve_conj().resolve_neg()
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    if sys.byteorder == "big":
        data = data.reshape(-1, tensor.element_size())[:, ::-1].copy()
    return data


class _Shard:
    """One safetensors file being written (see the module docstring): tensors of the first
    tensor's element size stream into `path` behind `reserve` bytes, every other size into a
    side file of its own."""

    def __init__(self, path: Path, reserve: int) -> None:
        self.path, self.reserve = path, reserve
        self.file: BinaryIO = open(path, "w+b", buffering=0)
        self.lead: Optional[int] = None  # the element size of the tensors in `file`
        self.sides: Dict[int, BinaryIO] = {}  # any other element size -> its side file
        self.written: Dict[int, int] = {}  # element size -> data bytes so far
        self.entries: Dict[int, List[Tuple[str, str, List[int], int]]] = {}
        self.names: List[str] = []
        self.nbytes = 0

    def _data(self, size: int) -> Tuple[BinaryIO, int]:
        """The file holding the tensors of element size `size` and where their data start."""
        return (self.file, self.reserve) if size == self.lead else (self.sides[size], 0)

    def add(self, name: str, dtype: str, shape: List[int], size: int,
            data: np.ndarray) -> None:
        if self.lead is None:
            self.lead = size
        if size not in self.written:
            self.written[size], self.entries[size] = 0, []
            if size != self.lead:
                self.sides[size] = open(self.path.with_name(f"{self.path.stem}.{size}.partial"),
                                        "w+b", buffering=0)
        file, start = self._data(size)
        _write_at(file, data, start + self.written[size])
        self.written[size] += data.nbytes
        self.entries[size].append((name, dtype, shape, data.nbytes))
        self.names.append(name)
        self.nbytes += data.nbytes

    def finish(self) -> int:
        """Complete `path` as a safetensors file; return the bytes its header needed."""
        try:
            order = sorted(self.written, reverse=True)  # element sizes, largest first
            header: Dict[str, object] = {"__metadata__": METADATA}
            offset = 0
            for size in order:
                for name, dtype, shape, nbytes in self.entries[size]:
                    header[name] = {"dtype": dtype, "shape": shape,
                                    "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            needed = _align8(8 + len(text))
            if order and order[0] == self.lead and needed <= self.reserve <= self.nbytes:
                end = self.reserve + self.written[self.lead]
                for size in order[1:]:
                    _copy(self.sides[size], 0, self.written[size], self.file, end)
                    end += self.written[size]
                _write_header(self.file, text, self.reserve)
            else:
                self._rewrite(order, text, needed)
            return needed
        finally:
            self.file.close()
            for side in self.sides.values():
                side.close()
                os.unlink(side.name)

    def _rewrite(self, order: List[int], text: bytes, needed: int) -> None:
        """`path` as the exact header and the data in `order`, copied from the shard's files."""
        target = self.path.with_name(f"{self.path.stem}.rewrite.partial")
        with open(target, "w+b", buffering=0) as out:
            _write_header(out, text, needed)
            end = needed
            for size in order:
                file, start = self._data(size)
                _copy(file, start, self.written[size], out, end)
                end += self.written[size]
        os.replace(target, self.path)


def _write_header(file: BinaryIO, text: bytes, space: int) -> None:
    """The length and the JSON `text` padded with spaces to fill the first `space` bytes."""
    _write_at(file, struct.pack("<Q", space - 8) + text.ljust(space - 8), 0)


class ShardWriter:
    """Tensors given one at a time, written to safetensors shards of at most `max_bytes` of data
    as they come (see the module docstring): memory holds one tensor (a copy of it when it is
    not contiguous), never a shard. Files are named as transformers names them at `close`.

    A tensor starts a new shard when it would take the current one, if not empty, over
    `max_bytes` (transformers' rule). `total_bytes` and `total_parameters` count what was added.
    """

    def __init__(self, folder: Path, max_bytes: int, prefix: str = "model") -> None:
        self.folder, self.max_bytes, self.prefix = Path(folder), max_bytes, prefix
        self.reserve = _align8(min(max(max_bytes // RESERVE_PER, MIN_RESERVE), MAX_RESERVE))
        self.shard: Optional[_Shard] = None
        self.shards: List[List[str]] = []  # the names in each finished shard
        self.names: Set[str] = set()
        self.total_bytes = self.total_parameters = 0

    def _partial(self, index: int) -> Path:
        return self.folder / f"{self.prefix}.shard-{index}.partial"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes to the current shard now; nothing of it is kept.

        Raises:
            ValueError: a dtype safetensors cannot store or a name already given (nothing is
                written for that tensor).
        """
        dtype = DTYPES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} cannot be written to "
                             f"safetensors (it stores {', '.join(sorted(DTYPES.values()))})")
        if name in self.names or name == "__metadata__":
            raise ValueError(f"tensor {name}: given twice (or a name safetensors reserves)")
        data = _tensor_bytes(tensor)
        if self.shard is not None and self.shard.nbytes + data.nbytes > self.max_bytes:
            self._finish_shard()
        if self.shard is None:
            self.shard = _Shard(self._partial(len(self.shards)), self.reserve)
        self.shard.add(name, dtype, list(tensor.shape), tensor.element_size(), data)
        self.names.add(name)
        self.total_bytes += data.nbytes
        self.total_parameters += tensor.numel()

    def _finish_shard(self) -> None:
        # no shard open: close() before any tensor, which writes a file without one
        shard = self.shard or _Shard(self._partial(len(self.shards)), self.reserve)
        needed = shard.finish()
        if needed > self.reserve:
            self.reserve = _align8(min(2 * needed, MAX_RESERVE))
        self.shards.append(shard.names)
        self.shard = None

    def close(self) -> None:
        """Complete the last shard and give every file its final name (with the index when
        there is more than one shard)."""
        if self.shard is not None or not self.shards:
            self._finish_shard()
        n = len(self.shards)
        if n == 1:
            os.replace(self._partial(0), self.folder / f"{self.prefix}.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            file = f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._partial(i), self.folder / file)
            weight_map.update((name, file) for name in names)
        index = {"metadata": {"total_parameters": self.total_parameters,
                              "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / f"{self.prefix}.safetensors.index.json").write_text(
            json.dumps(index, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
