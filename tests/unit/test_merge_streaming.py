"""merge_datasets.py in bounded memory (megatron/data/storage/merge.py) against the merge it
replaces (the builder's add_index: indexed_dataset.merge_datasets, `old_merge` below): byte for byte on 1, 2 and 5
inputs with an empty one, sentence data, sequences with gaps in the .bin, sidecars and legacy
TNTIDX, with chunks small enough that every array crosses chunk boundaries; bad inputs refused
with one message naming the file, exit 2, nothing written."""

import os
import struct

import numpy as np
import pytest

from data_tools import merge_datasets as cli
from megatron.data.storage import merge
from megatron.data.storage.data_meta import DatasetMeta, read_meta
from megatron.data.storage.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    merge_datasets,
)


def old_merge(prefixes, output_prefix):
    """The merge the streaming one replaces, the reference: the library's in-memory
    indexed_dataset.merge_datasets (the builder's add_index)."""
    merge_datasets(prefixes, output_prefix)


META = DatasetMeta(tokenizer={"type": "SentencePieceTokenizer", "model": "t5.model"}, eod_id=1,
                   eod_appended=True, dtype="", documents=0, sequences=0, tokens=0)


def write(prefix, rng, documents, sentences=1, dtype=np.uint16, meta=META):
    """`documents` random documents of 1..`sentences` sequences (some empty) at `prefix`."""
    with IndexedDatasetBuilder(prefix + ".bin", dtype) as b:
        for _ in range(documents):
            for _ in range(int(rng.integers(1, sentences + 1))):
                b.add_item(rng.integers(0, 30000, size=int(rng.integers(0, 12))))
            b.end_document()
        b.finalize(prefix + ".idx", meta)
    return prefix


def write_gapped(prefix, rng, documents):
    """An MMIDIDX whose sequences have junk between them in the .bin (valid: the reader and the
    old merge copy sequence by sequence)."""
    lengths = rng.integers(0, 9, size=documents).astype(np.int32)
    pointers, data, at = [], b"", 0
    for n in lengths:
        gap = int(rng.integers(0, 3)) * 2
        data += b"\xee" * gap + rng.integers(0, 999, size=int(n)).astype(np.uint16).tobytes()
        pointers.append(at + gap)
        at += gap + 2 * int(n)
    with open(prefix + ".bin", "wb") as f:
        f.write(data + b"\xee" * 4)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, documents, documents + 1))
        f.write(lengths.tobytes() + np.asarray(pointers, dtype=np.int64).tobytes())
        f.write(np.arange(documents + 1, dtype=np.int64).tobytes())
    return prefix


def write_legacy(prefix, rng, documents):
    """A legacy TNTIDX of one int32 sequence per document."""
    seqs = [rng.integers(0, 99999, size=int(rng.integers(1, 7))) for _ in range(documents)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"TNTIDX\x00\x00" + struct.pack("<QQQQQQ", 1, 4, 4, documents, documents,
                                                  documents + 1))
        f.write(np.arange(documents + 1, dtype=np.int64).tobytes() + offsets.tobytes())
        f.write(np.diff(offsets).tobytes() + np.arange(documents + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate(seqs).astype(np.int32).tobytes())
    return prefix


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(merge, "CHUNK_ITEMS", 7)
    monkeypatch.setattr(merge, "COPY_BYTES", 10)


def outputs(prefix):
    return {ext: open(prefix + ext, "rb").read() if os.path.exists(prefix + ext) else None
            for ext in (".bin", ".idx", ".meta.json")}


def assert_same_as_old(tmp_path, prefixes):
    old_merge(prefixes, str(tmp_path / "old"))
    assert cli.main(["--input", *prefixes, "--output-prefix", str(tmp_path / "new")]) == 0
    assert outputs(str(tmp_path / "new")) == outputs(str(tmp_path / "old"))
    assert sorted(p.name for p in tmp_path.glob("new*")) == \
        sorted(p.name.replace("old", "new") for p in tmp_path.glob("old*"))


@pytest.mark.parametrize("count", [1, 2, 5])
def test_same_bytes_as_the_old_merge(tmp_path, count):
    rng = np.random.default_rng(count)
    sizes = [23, 0, 40, 7, 16][:count]  # the second input, where there is one, is empty
    prefixes = [write(str(tmp_path / f"in{k}"), rng, n, sentences=3)
                for k, n in enumerate(sizes)]
    assert_same_as_old(tmp_path, prefixes)
    merged = IndexedDataset(str(tmp_path / "new"))
    assert merged.num_documents == sum(sizes)
    assert read_meta(str(tmp_path / "new")).documents == sum(sizes)


def test_same_bytes_with_gaps_legacy_and_without_sidecars(tmp_path):
    rng = np.random.default_rng(7)
    a = write(str(tmp_path / "a"), rng, 30, dtype=np.int32, meta=None)
    b = write_legacy(str(tmp_path / "b"), rng, 20)
    c = write(str(tmp_path / "c"), rng, 0, dtype=np.int32)
    assert_same_as_old(tmp_path, [a, b, c, a])
    assert outputs(str(tmp_path / "new"))[".meta.json"] is None
    gapped = [write_gapped(str(tmp_path / f"g{k}"), rng, 25) for k in range(2)]
    assert_same_as_old(tmp_path, gapped + [write(str(tmp_path / "d"), rng, 9)])


def test_sidecars_that_disagree_give_none_and_an_old_one_is_removed(tmp_path):
    rng = np.random.default_rng(3)
    a = write(str(tmp_path / "a"), rng, 10)
    b = write(str(tmp_path / "b"), rng, 10, meta=DatasetMeta(**{**META.__dict__, "eod_id": 2}))
    (tmp_path / "new.meta.json").write_text("stale")
    (tmp_path / "old.meta.json").write_text("stale")
    assert_same_as_old(tmp_path, [a, b])
    assert not (tmp_path / "new.meta.json").exists()


def test_directory_and_glob_inputs(tmp_path):
    rng = np.random.default_rng(4)
    parts = tmp_path / "parts"
    parts.mkdir()
    prefixes = [write(str(parts / f"shard-{k:05d}"), rng, 5 + k) for k in range(3)]
    old_merge(prefixes, str(tmp_path / "old"))
    for given in ([str(parts)], [str(parts / "shard-*")], prefixes):
        assert cli.main(["--input", *given, "--output-prefix", str(tmp_path / "new")]) == 0
        assert outputs(str(tmp_path / "new")) == outputs(str(tmp_path / "old"))


def refused(tmp_path, capsys, prefixes):
    before = sorted(os.listdir(tmp_path))
    assert cli.main(["--input", *prefixes, "--output-prefix", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, not even temporaries
    assert len(err.splitlines()) == 1
    return err


def test_truncated_index_is_named(tmp_path, capsys):
    rng = np.random.default_rng(5)
    good = write(str(tmp_path / "good"), rng, 10)
    bad = write(str(tmp_path / "bad"), rng, 10)
    with open(bad + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(bad + ".idx") - 8)
    err = refused(tmp_path, capsys, [good, bad])
    assert f"{bad}.idx" in err and "truncated" in err
    with open(bad + ".idx", "r+b") as f:
        f.truncate(20)  # inside the header
    assert f"{bad}.idx" in refused(tmp_path, capsys, [good, bad])


def test_missing_bin_and_mixed_dtypes_are_named(tmp_path, capsys):
    rng = np.random.default_rng(6)
    good = write(str(tmp_path / "good"), rng, 10)
    wide = write(str(tmp_path / "wide"), rng, 10, dtype=np.int32)
    err = refused(tmp_path, capsys, [good, wide])
    assert "dtypes differ" in err and f"{good} (uint16)" in err and f"{wide} (int32)" in err
    os.unlink(good + ".bin")
    assert f"{good}.bin" in refused(tmp_path, capsys, [good])


def test_corrupt_arrays_found_while_streaming_leave_nothing(tmp_path, capsys):
    """A header that is fine over arrays that are not: found mid-merge, after the first input
    was copied; the temporaries go and an existing output stays as it was."""
    rng = np.random.default_rng(8)
    good = write(str(tmp_path / "good"), rng, 30)
    bad = write(str(tmp_path / "bad"), rng, 30)
    ds = IndexedDataset(bad)
    at = 34 + 12 * len(ds) + 8 * 20  # document index 20 set below index 19
    del ds
    with open(bad + ".idx", "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<q", 1))
    old_merge([good], str(tmp_path / "out"))
    kept = outputs(str(tmp_path / "out"))
    err = refused(tmp_path, capsys, [good, bad])
    assert f"{bad}.idx: corrupt index field 'document_indices': [20]" in err
    assert outputs(str(tmp_path / "out")) == kept
    with open(bad + ".idx", "r+b") as f:  # a pointer past the end of the .bin
        f.seek(at)
        f.write(struct.pack("<q", 20))
        f.seek(34 + 4 * 30 + 8 * 29)
        f.write(struct.pack("<q", 10 ** 6))
    err = refused(tmp_path, capsys, [good, bad])
    assert f"{bad}.idx: corrupt index field 'sequence_pointers': [29]" in err


def test_inputs_are_not_held_open(tmp_path):
    """A merge of thousands of shards must not hold two files per shard (ulimit -n is often
    1024): each input's files are open only while the merge reads them."""
    rng = np.random.default_rng(9)
    prefixes = [write(str(tmp_path / f"in{k}"), rng, 5) for k in range(6)]
    before = len(os.listdir("/proc/self/fd"))
    inputs = merge.open_inputs(prefixes)
    assert len(os.listdir("/proc/self/fd")) == before
    merge.merge_streaming(inputs, str(tmp_path / "out"))
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_interrupted_merge_leaves_nothing(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(10)
    prefixes = [write(str(tmp_path / f"in{k}"), rng, 9) for k in range(3)]
    before = sorted(os.listdir(tmp_path))

    def stop_at_the_third(number, item):
        if number == 2:
            raise KeyboardInterrupt

    inputs = merge.open_inputs(prefixes)
    with pytest.raises(KeyboardInterrupt):
        merge.merge_streaming(inputs, str(tmp_path / "out"), progress=stop_at_the_third)
    assert sorted(os.listdir(tmp_path)) == before
    real = cli.merge_streaming
    monkeypatch.setattr(cli, "merge_streaming", lambda inputs, out, storage: real(
        inputs, out, storage, progress=stop_at_the_third))
    assert cli.main(["--input", *prefixes, "--output-prefix", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == \
        f"interrupted: nothing was written to {tmp_path / 'out'}"
    assert sorted(os.listdir(tmp_path)) == before
