"""What opening a dataset reads of its `.bin`: pages touched (local) and bytes fetched (s3://).

    python bench/bench_data_open.py [--mb 40] [--write]

Makes an English `.bin` of about --mb MB (the test corpora tokenized by preprocess_data.py with
--append-eod, then merged with copies of itself), and measures, against the scan that opening
used to do (every document's last token: `np.memmap(...)[ends]` on a file, RemoteBin.items with
a 4 MiB merge gap on object storage, the code removed from t5_dataset.py):

- local: pages of the `.bin` in the page cache (mincore) after its pages were dropped
  (posix_fadvise DONTNEED) and the train split's T5 dataset was built for 24 samples, with the
  sidecar and without it; then after those 24 samples were read;
- s3://: bytes the server sent (counted by a TCP proxy in front of `rclone serve s3`) during a
  real DP-2 training run of 24 samples (`torchrun --nproc-per-node 2 -m megatron.pretrain_t5`,
  tiny model, 3 steps of 8), with and without the sidecar; the index download is included.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "objectstore")]

from bench.common import WORK, machine_line, make_english_jsonl, write_section  # noqa: E402
from megatron.data.storage.data_meta import meta_file_path, read_meta, write_meta_file  # noqa: E402
from megatron.data.storage.indexed_dataset import IndexedDataset, merge_datasets  # noqa: E402

TINY = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
            dropout_rate=0.0)


def make_data(folder: Path, mb: float):
    """(prefix without sidecar, prefix with one, the SentencePiece model)."""
    from data_tools import preprocess_data, train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    text = make_english_jsonl(folder / "en.jsonl", 4.0)
    spm = folder / "spm.model"
    if not spm.exists():
        assert train_tokenizer.main(["--input", str(text), "--output-prefix", str(folder / "spm"),
                                     "--vocab-size", "4000", "--model-type", "unigram",
                                     "--byte-fallback", "--num-threads", "2", "--seed", "1",
                                     "--input-sentence-size", "20000"]) == 0
    part = str(folder / "part_text_document")
    if not os.path.exists(part + ".idx"):
        assert preprocess_data.main(["--input", str(text), "--output-prefix",
                                     str(folder / "part"), "--tokenizer-model", str(spm),
                                     "--append-eod", "--workers", "2", "--no-progress"]) == 0
    copies = max(1, round(mb * 1e6 / os.path.getsize(part + ".bin")))
    bare = str(folder / "en_text_document")
    merge_datasets([part] * copies, bare)
    os.remove(meta_file_path(bare))  # the merged sidecar dropped: as Megatron-LM's data
    ds = IndexedDataset(bare)
    dressed = str(folder / "en_meta_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(bare + suffix, dressed + suffix)
    write_meta_file(meta_file_path(dressed), replace(
        read_meta(part), documents=ds.num_documents, sequences=len(ds), tokens=ds.num_tokens))
    return bare, dressed, spm


def document_end_positions(ds) -> np.ndarray:
    """Token positions of every document's last token (what the removed scan read)."""
    bounds = np.asarray(ds.document_indices, dtype=np.int64)
    last = bounds[1:] - 1
    return (np.asarray(ds.sequence_pointers)[last] // ds.dtype.itemsize
            + np.asarray(ds.sequence_lengths)[last] - 1)


# Local: pages in the page cache -----------------------------------------------------------------
def drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_pages(path: str):
    """(pages of `path` in the page cache, pages of the file), by mincore(2)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


def local_rows(bare: str, dressed: str, spm: Path):
    from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpanCorruptionDataset, T5SpecialTokens
    from megatron.data.tokenizers.tokenizer import T5Tokenizer

    tokens = T5SpecialTokens.from_tokenizer(T5Tokenizer(str(spm)))
    rows = []

    def measure(label, prefix, action):
        drop_pages(prefix + ".bin")
        before, pages = resident_pages(prefix + ".bin")
        result = action()
        after, _ = resident_pages(prefix + ".bin")
        rows.append((label, before, after, pages))
        return result

    ds = IndexedDataset(bare)
    ends = document_end_positions(ds)
    measure("the scan this replaced: np.memmap(.bin)[every document's last token]", bare,
            lambda: int(np.memmap(bare + ".bin", dtype=ds.dtype, mode="r")[ends].sum()))

    def build(prefix, cache):
        indexed = IndexedDataset(prefix)
        return T5SpanCorruptionDataset("train", indexed, (0, indexed.num_documents), 24,
                                       T5DatasetConfig(64, seed=1), tokens, str(cache))

    work = Path(bare).parent
    for label, prefix in (("open, with the sidecar (64 sampled ends checked)", dressed),
                          ("open, no sidecar (64 sampled ends decide)", bare)):
        shutil.rmtree(work / "cache", ignore_errors=True)
        built = measure(label, prefix, lambda p=prefix: build(p, work / "cache"))
    measure("then the 24 samples read", bare, lambda: [built[i] for i in range(24)])
    return rows, ds


# s3://: bytes on the wire -------------------------------------------------------------------------
def read_ahead_kb(path: str) -> str:
    """The read-ahead of the block device holding `path` (its bdi's read_ahead_kb)."""
    dev = os.stat(path).st_dev
    try:
        return Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text().strip()
    except OSError:
        return "unknown"


class CountingProxy:
    """A TCP forwarder to `target` counting the bytes sent back to its clients."""

    def __init__(self, target):
        self.target, self.received = target, 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(conn, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, True), daemon=True).start()

    def _pump(self, src, dst, count):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if count:
                    with self._lock:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._sock.close()


def train_command(url: str, spm: Path, model: Path, cache: Path):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "megatron.pretrain_t5", "--data-path", url, "--tokenizer-model", str(spm),
            "--model-config", str(model), "--lr", "1e-3", "--train-iters", "3",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--encoder-seq-length", "64",
            "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
            "--data-cache-path", str(cache)]


def s3_rows(bare: str, dressed: str, spm: Path, work: Path):
    from s3_server import S3Server

    from megatron.data.storage import object_storage

    rows = []
    model = work / "tiny.json"
    model.write_text(json.dumps(TINY))
    with S3Server() as server:
        client = server.client()
        client.create_bucket(Bucket="corpus")
        for name, prefix, sidecar in (("bare", bare, False), ("dressed", dressed, True)):
            for suffix in (".bin", ".idx") + ((".meta.json",) if sidecar else ()):
                client.upload_file(prefix + suffix, "corpus", f"en/{name}{suffix}")
        os.environ.update(server.env())
        storage = object_storage.ObjectStorage(
            object_storage.StorageSettings(cache_path=str(work / "node-scan")))
        remote = IndexedDataset("s3://corpus/en/bare", storage=storage)
        ends = document_end_positions(remote) * remote.dtype.itemsize
        remote.remote.items(ends, remote.dtype.itemsize, gap=4 * 1024 * 1024)
        rows.append(("the scan this replaced: RemoteBin.items(every last token, 4 MiB gap)",
                     remote.remote.fetched_bytes, remote.remote.requests, None))
        for name, label in (("dressed", "DP-2 training, 24 samples, with the sidecar"),
                            ("bare", "DP-2 training, 24 samples, no sidecar")):
            proxy = CountingProxy(server.address)
            env = {**os.environ, **server.env(f"http://127.0.0.1:{proxy.port}"),
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            cache = work / f"node-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            cmd = train_command(f"s3://corpus/en/{name}", spm, model, cache)
            t0 = time.time()
            done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"training failed:\n{done.stderr[-3000:]}")
            proxy.close()
            rows.append((label, proxy.received, None, time.time() - t0))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=40.0, help="size of the .bin, about")
    p.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    args = p.parse_args()
    work = WORK / "data_open"
    bare, dressed, spm = make_data(work, args.mb)
    size = os.path.getsize(bare + ".bin")
    idx = os.path.getsize(bare + ".idx")
    local, ds = local_rows(bare, dressed, spm)
    remote = s3_rows(bare, dressed, spm, work)
    lines = [
        "## opening a dataset (what is read of the .bin before the first step)",
        "",
        f"`python bench/bench_data_open.py --mb {args.mb:g}` on {machine_line()}. English "
        f"(the test corpora tokenized with `--append-eod`, merged with copies of itself): "
        f"`.bin` {size / 1e6:.1f} MB, {ds.num_documents} documents, `.idx` {idx / 1e6:.2f} MB.",
        "",
        "Local file: pages of the `.bin` in the page cache (mincore), dropped before each line",
        "",
        "| what | pages before | pages after | of the file's |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {label} | {b} | {a} ({100 * a / n:.2f}%) | {n} |" for label, b, a, n in local]
    lines += ["", f"Opening reads one token per sampled document with `pread` under "
              f"POSIX_FADV_RANDOM: one page each. The samples are read through the C++ reader's "
              f"mapping of the `.bin`, where each page fault reads around it as far as the "
              f"block device's read-ahead allows ({read_ahead_kb(bare + '.bin')} KB here): that, "
              f"not the samples' bytes, is the last line's figure."]
    lines += ["", "s3:// (`rclone serve s3`): bytes the server sent, counted by a TCP proxy "
              "(for training: both ranks, the `.idx` download and HTTP headers included)", "",
              "| what | bytes | share of the .bin | requests | wall s |", "| --- | --- | --- | --- | --- |"]
    for label, nbytes, requests, wall in remote:
        lines.append(f"| {label} | {nbytes / 1e6:.3f} MB | {100 * nbytes / size:.1f}% | "
                     f"{requests if requests is not None else ''} | "
                     f"{f'{wall:.0f}' if wall is not None else ''} |")
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section("data_open", body)


if __name__ == "__main__":
    main()
