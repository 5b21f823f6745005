"""Corrupt .idx/.bin files raise a clear CorruptIndexError naming file and field; none crashes."""

import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from megatron.data.storage.indexed_dataset import CorruptIndexError, IndexedDataset, IndexedDatasetBuilder

HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, N, D


@pytest.fixture
def dataset(tmp_path):
    """A valid uint16 dataset of 3 documents / 5 sequences; returns (prefix, idx bytes, N, D)."""
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
        b.add_document(np.arange(10), [4, 6])
        b.add_document(np.arange(7), [7])
        b.add_document(np.arange(5), [2, 3])
        b.finalize(prefix + ".idx")
    return prefix, bytearray(open(prefix + ".idx", "rb").read()), 5, 4


def rewrite(prefix, idx: bytes):
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)


def expect_corrupt(prefix, field):
    with pytest.raises(CorruptIndexError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert prefix in message and f"'{field}'" in message, message
    return message


def put(idx, offset, fmt, value):
    idx[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)


def expect_each_corrupt(prefix, idx, cases):
    """Each (offset, struct format, value, field): writing the value there is caught by field."""
    for offset, fmt, value, field in cases:
        bad = bytearray(idx)
        put(bad, offset, fmt, value)
        rewrite(prefix, bytes(bad))
        expect_corrupt(prefix, field)


def lengths_at(i):
    return HEADER + 4 * i


def pointers_at(i, n=5):
    return HEADER + 4 * n + 8 * i


def docs_at(j, n=5):
    return HEADER + 12 * n + 8 * j


@pytest.mark.parametrize("size", [0, 5, 9, 17, 25, HEADER, HEADER + 7, -1])
def test_truncated_index(dataset, size):
    prefix, idx, _, _ = dataset
    rewrite(prefix, bytes(idx[:size]))
    with pytest.raises(CorruptIndexError, match=r"d\.idx"):
        IndexedDataset(prefix)


def test_truncated_bin(dataset):
    prefix, _, _, _ = dataset
    data = open(prefix + ".bin", "rb").read()
    with open(prefix + ".bin", "wb") as f:
        f.write(data[:-2])
    assert "d.bin" in expect_corrupt(prefix, "sequence_pointers")


def test_header_fields(dataset):
    prefix, idx, _, _ = dataset
    cases = [
        (0, "9s", b"MMIDIDX\x00\x01", "magic"),
        (0, "9s", b"GARBAGE!!", "magic"),
        (9, "<Q", 2, "version"),
        (17, "<B", 0, "dtype_code"),
        (17, "<B", 9, "dtype_code"),
        (18, "<Q", 6, "sequence_count"),
        (18, "<Q", 2**63 + 5, "sequence_count"),
        (18, "<Q", 2**64 - 1, "sequence_count"),
        (26, "<Q", 2**61, "document_count"),
    ]
    expect_each_corrupt(prefix, idx, cases)


def test_index_arrays(dataset):
    prefix, idx, n, d = dataset
    cases = [
        (lengths_at(1), "<i", -3, "sequence_lengths"),
        (lengths_at(4), "<i", 2**31 - 1, "sequence_pointers"),  # runs past the .bin
        (pointers_at(2), "<q", 0, "sequence_pointers"),  # goes backwards: overlaps
        (pointers_at(3), "<q", 2**62, "sequence_pointers"),  # past the end of .bin
        (pointers_at(1), "<q", -8, "sequence_pointers"),
        (pointers_at(4), "<q", 35, "sequence_pointers"),  # not a multiple of 2 bytes
        (docs_at(0), "<q", 1, "document_indices"),
        (docs_at(2), "<q", 1, "document_indices"),  # not monotone
        (docs_at(d - 1), "<q", n - 1, "document_indices"),  # does not end at N
        (docs_at(d - 1), "<q", 2**63 - 1, "document_indices"),
    ]
    expect_each_corrupt(prefix, idx, cases)


def test_empty_document_index(tmp_path):
    prefix = str(tmp_path / "e")
    rewrite(prefix, b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 0, 0))
    open(prefix + ".bin", "wb").close()
    expect_corrupt(prefix, "document_indices")


def test_empty_dataset_is_valid(tmp_path):
    prefix = str(tmp_path / "e")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
        b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


def test_legacy_fields(tmp_path):
    from test_indexed_dataset import write_legacy

    prefix = str(tmp_path / "old")
    write_legacy(prefix, [[np.arange(4), np.arange(3)], [np.arange(5)]])
    good = bytearray(open(prefix + ".idx", "rb").read())
    n = 3
    cases = [
        (16, "<Q", 9, "dtype_code"),
        (24, "<Q", 2, "element_size"),
        (32, "<Q", 2**62, "sequence_count"),
        (56 + 8 * (n + 1) + 8 * 2, "<q", 1, "data_offsets"),  # goes backwards
        (56 + 8 * 1, "<q", 3, "dim_offsets"),  # a 2-D sequence
        (56 + 16 * (n + 1) + 8 * 1, "<q", 99, "sizes"),
        (56 + 16 * (n + 1) + 8 * n + 8, "<q", 5, "document_indices"),
    ]
    for offset, fmt, value, field in cases:
        bad = bytearray(good)
        put(bad, offset, fmt, value)
        rewrite(prefix, bytes(bad))
        with pytest.raises(CorruptIndexError, match=f"'{field}'"):
            IndexedDataset(prefix, impl="lazy")
    rewrite(prefix, bytes(good))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(CorruptIndexError, match="old.bin"):
        IndexedDataset(prefix, impl="lazy")


FUZZ = textwrap.dedent(
    """
    import os, shutil, sys
    import numpy as np
    from megatron.data.storage.indexed_dataset import IndexedDataset
    good, work, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(seed)
    outcomes = {"rejected": 0, "valid": 0}
    for trial in range(400):
        for ext in (".idx", ".bin"):
            shutil.copyfile(good + ext, work + ext)
        ext = ".idx" if rng.random() < 0.8 else ".bin"
        data = bytearray(open(work + ext, "rb").read())
        if rng.random() < 0.3:
            data = data[: int(rng.integers(0, len(data)))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                pos = int(rng.integers(0, len(data)))
                data[pos] = int(rng.integers(0, 256))
        open(work + ext, "wb").write(bytes(data))
        try:
            ds = IndexedDataset(work, impl="infer")
        except ValueError:
            outcomes["rejected"] += 1
            continue
        # Whatever was accepted must be fully readable within the files.
        for i in range(len(ds)):
            assert ds[i].size == ds.sequence_lengths[i]
            int(ds[i].astype(np.int64).sum())  # touch every token
        outcomes["valid"] += 1
    print(outcomes)
    """
)


@pytest.mark.parametrize("legacy", [False, True])
def test_fuzz_never_crashes(tmp_path, legacy):
    """Random byte flips and truncations, in a child process so that a crash shows as a failure."""
    good = str(tmp_path / "good")
    rng = np.random.default_rng(7)
    docs = [[rng.integers(0, 30000, size=int(rng.integers(1, 30))) for _ in range(3)]
            for _ in range(8)]
    if legacy:
        from test_indexed_dataset import write_legacy

        write_legacy(good, docs)
    else:
        with IndexedDatasetBuilder(good + ".bin", np.uint16) as b:
            for doc in docs:
                b.add_document(np.concatenate(doc), [len(s) for s in doc])
            b.finalize(good + ".idx")
    proc = subprocess.run(
        [sys.executable, "-c", FUZZ, good, str(tmp_path / "work"), str(int(legacy))],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"fuzz child died with {proc.returncode}:\n{proc.stderr[-3000:]}"
    outcomes = eval_outcomes(proc.stdout)
    assert outcomes["rejected"] > 200  # most mutations of a small index must be caught


def eval_outcomes(stdout: str) -> dict:
    import ast

    return ast.literal_eval(stdout.strip().splitlines()[-1])
