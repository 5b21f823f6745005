"""megatron/checkpoint/formats/shards.py: ShardWriter's files read back bit for bit by safetensors itself
(every dtype it stores, odd shapes, a scalar, empty, non-contiguous and storage-sharing tensors),
split and named as transformers splits and names them, with each tensor streamed to disk as it
comes (a subprocess's peak RSS stays within a few tensors while it writes a 384 MiB shard), and
a failure that leaves no file under a final name.

Against `safetensors.torch.save_file` of the same tensors, the tensors and each header entry's
dtype and shape are identical; the bytes of the files may differ, by design, in the header: its
padding (ours fills the space reserved at the start of the file with spaces) and the order of
the tensors of one element size (ours: as they came; safetensors: by name)."""

import errno
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open

from megatron.checkpoint.formats import shards
from megatron.checkpoint.formats.hf import SAFE_INDEX, SAFE_SINGLE
from megatron.checkpoint.formats.hf import ShardWriter as HFShardWriter
from megatron.checkpoint.formats.shards import DTYPES, MIN_RESERVE, ShardWriter

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def random_tensor(dtype, shape, seed):
    """Random bytes viewed as `dtype` (NaNs and infinities included for the float types), so
    only a bit-exact copy compares equal."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def bits(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def assert_same(a, b, name):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(bits(a), bits(b)), name


def zoo():
    """(name, tensor) pairs of every dtype and of the awkward kinds, in an order that mixes
    element sizes."""
    tensors = [(f"odd.{DTYPES[d]}", random_tensor(d, (3, 5, 7), i))
               for i, d in enumerate(DTYPES)]
    base = random_tensor(torch.float32, (6, 10), 99)
    tensors += [
        ("scalar", torch.tensor(3.25, dtype=torch.float64)),
        ("empty", torch.empty((0, 4), dtype=torch.bfloat16)),
        ("empty.rows", torch.empty((2, 0), dtype=torch.int8)),
        ("transposed", base.t()),  # not contiguous
        ("strided", base[::2, 1::3]),
        ("view.top", base[:3]),  # two views of one storage
        ("view.bottom", base[3:]),
        ("conj", torch.complex(base[:2], base[2:4]).conj()),
    ]
    return tensors


def read_folder(folder, prefix="model"):
    """{name: tensor} of a folder through safetensors, each file's header entries and the files
    read (checking that every tensor starts at a multiple of its element size)."""
    index = folder / f"{prefix}.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.exists() else [f"{prefix}.safetensors"]
    tensors, headers = {}, {}
    for file in files:
        header = read_header(folder / file)
        with safe_open(str(folder / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}  # what transformers checks
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
                start = 8 + header["__length__"] + header[name]["data_offsets"][0]
                assert start % tensors[name].element_size() == 0, (file, name)
        headers.update((k, v) for k, v in header.items() if not k.startswith("__"))
    return tensors, headers, files


def read_header(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header["__length__"] = length
    return header


def write(folder, tensors, max_bytes, **kwargs):
    writer = ShardWriter(folder, max_bytes, **kwargs)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()
    return writer


def test_hf_reexports_the_writer():
    assert HFShardWriter is ShardWriter
    assert (SAFE_SINGLE, SAFE_INDEX) == ("model.safetensors", "model.safetensors.index.json")


@pytest.mark.parametrize("max_bytes", [10 ** 9, 700], ids=["single", "sharded"])
def test_every_dtype_reads_back_as_save_file_writes_it(tmp_path, max_bytes):
    tensors = zoo()
    (tmp_path / "ours").mkdir()
    writer = write(tmp_path / "ours", tensors, max_bytes)
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_file({k: v.resolve_conj().contiguous().clone() for k, v in tensors},
                                reference, metadata={"format": "pt"})
    ours, headers, files = read_folder(tmp_path / "ours")
    theirs = safetensors.torch.load_file(reference)
    assert set(ours) == set(theirs) == {name for name, _ in tensors}
    for name, tensor in tensors:
        assert_same(ours[name], tensor.resolve_conj(), name)
        assert_same(ours[name], theirs[name], name)
    expected_headers = {k: {"dtype": v["dtype"], "shape": v["shape"]}
                        for k, v in read_header(reference).items() if not k.startswith("__")}
    assert {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in headers.items()} == \
        expected_headers
    assert writer.total_bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    assert writer.total_parameters == sum(t.numel() for _, t in tensors)
    assert (len(files) == 1) == (max_bytes == 10 ** 9)
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(
        files + ([] if len(files) == 1 else [SAFE_INDEX]))


def test_shards_split_and_index_as_the_sizes_imply(tmp_path):
    # max_bytes 100, bytes 40, 40, 40, 100, 0, 10: a tensor starts a new shard when it would take
    # a non-empty one over 100 bytes.
    tensors = [("a", torch.ones(10)), ("b", torch.ones(20, dtype=torch.float16)),
               ("c", torch.ones(5, dtype=torch.float64)), ("d", torch.ones(25)),
               ("e", torch.ones(0)), ("f", torch.ones(10, dtype=torch.int8))]
    write(tmp_path, tensors, 100)
    names = [f"model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    assert index == {"metadata": {"total_parameters": 70, "total_size": 230},
                     "weight_map": {"a": names[0], "b": names[0], "c": names[1], "d": names[2],
                                    "e": names[2], "f": names[3]}}
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names + [SAFE_INDEX])
    ours, _, _ = read_folder(tmp_path)
    for name, tensor in tensors:
        assert_same(ours[name], tensor, name)


def test_named_and_split_as_transformers_does(tmp_path):
    """transformers' save_pretrained splits with huggingface_hub: where no tensor is above the
    shard size and none shares memory, its files and weight map are ours."""
    state = {f"block.{i}.weight": random_tensor(torch.float32, (i % 4 + 1, 16), i)
             for i in range(23)}
    write(tmp_path, state.items(), 300)
    split = split_torch_state_dict_into_shards(state, max_shard_size=300)
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    assert index["weight_map"] == dict(sorted(split.tensor_to_filename.items()))
    assert index["metadata"]["total_size"] == split.metadata["total_size"]
    ours, _, files = read_folder(tmp_path)
    assert files == sorted(split.filename_to_tensors) and len(files) > 2
    for name, tensor in state.items():
        assert_same(ours[name], tensor, name)


def test_prefix_shares_a_folder(tmp_path):
    write(tmp_path, [("w", torch.ones(4))], 10 ** 9)
    write(tmp_path, [("w", torch.zeros(4)), ("v", torch.ones(4))], 16, prefix="exp_avg")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "exp_avg-00001-of-00002.safetensors", "exp_avg-00002-of-00002.safetensors",
        "exp_avg.safetensors.index.json", "model.safetensors"]
    assert json.loads((tmp_path / "exp_avg.safetensors.index.json").read_text())["weight_map"] \
        == {"v": "exp_avg-00002-of-00002.safetensors", "w": "exp_avg-00001-of-00002.safetensors"}
    assert torch.equal(read_folder(tmp_path, "exp_avg")[0]["w"], torch.zeros(4))
    assert torch.equal(read_folder(tmp_path)[0]["w"], torch.ones(4))


def test_no_tensor_writes_an_empty_file(tmp_path):
    write(tmp_path, [], 10 ** 9)
    assert safetensors.torch.load_file(tmp_path / SAFE_SINGLE) == {}
    assert [p.name for p in tmp_path.iterdir()] == [SAFE_SINGLE]


def test_header_written_in_place_or_the_shard_rewritten(tmp_path):
    """The header goes into the reserved space when the shard's data are at least that big and
    its first tensor has the largest element size (other sizes copied in behind it); otherwise
    the shard is rewritten with an exact header (padded to a multiple of 8)."""
    big = random_tensor(torch.float32, (MIN_RESERVE // 4,), 1)  # as many bytes as the reserve
    mixed = [("big", big), ("flags", random_tensor(torch.bool, (7,), 2)),
             ("half", random_tensor(torch.bfloat16, (3, 3), 3)), ("byte", torch.ones(1))]
    for case, tensors, in_place in [("in_place", mixed, True),
                                    ("larger_later", mixed[1:] + mixed[:1], False),
                                    ("small", [("one", torch.ones(3))], False)]:
        folder = tmp_path / case
        folder.mkdir()
        write(folder, tensors, 1 << 20)  # the least reserve, MIN_RESERVE
        length = read_header(folder / SAFE_SINGLE)["__length__"]
        assert (length == MIN_RESERVE - 8) == in_place, case
        assert (8 + length) % 8 == 0
        ours, _, _ = read_folder(folder)
        for name, tensor in tensors:
            assert_same(ours[name], tensor, name)
        assert [p.name for p in folder.iterdir()] == [SAFE_SINGLE]


def test_header_beyond_the_reserve(tmp_path):
    """1000 long names need more header than the 64 KiB reserved: that shard is rewritten and
    the next reserves twice what it needed, so its header is written in place."""
    long = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight.padding"
    tensors = [(long.format(i), random_tensor(torch.float32, (256,), i)) for i in range(2000)]
    write(tmp_path, tensors, 1000 * 1024)
    first, second = (read_header(tmp_path / f"model-0000{i}-of-00002.safetensors")
                     for i in (1, 2))
    assert first["__length__"] > MIN_RESERVE
    assert len(first) == len(second) == 1000 + 2  # the tensors, __metadata__ and __length__
    assert second["__length__"] + 8 == 2 * (first["__length__"] + 8)
    assert second["__length__"] > len(json.dumps({k: v for k, v in second.items()
                                                  if k != "__length__"}))  # padded with spaces
    ours, _, _ = read_folder(tmp_path)
    for name, tensor in tensors:
        assert_same(ours[name], tensor, name)


def test_copies_without_copy_file_range(tmp_path, monkeypatch):
    """Where the kernel cannot copy between the files, the bounded buffer does it."""
    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(shards, "COPY_CHUNK", 1000)
    tensors = [("big", random_tensor(torch.float32, (MIN_RESERVE // 4 + 999,), 1)),
               ("flags", random_tensor(torch.bool, (2001,), 2)),
               ("half", random_tensor(torch.float16, (3001,), 3))]
    for case, order in [("in_place", tensors), ("rewritten", tensors[::-1])]:
        (tmp_path / case).mkdir()
        write(tmp_path / case, order, 10 ** 9)
        ours, _, _ = read_folder(tmp_path / case)
        for name, tensor in tensors:
            assert_same(ours[name], tensor, name)


@pytest.mark.parametrize("bad", [torch.ones(2, dtype=torch.complex128), "twice"])
def test_a_failure_leaves_no_final_file(tmp_path, bad):
    writer = ShardWriter(tmp_path, 100)
    for i in range(5):  # two shards finished, one open
        writer.add(f"t{i}", torch.ones(10))
    if isinstance(bad, str):
        with pytest.raises(ValueError, match="tensor t3: given twice"):
            writer.add("t3", torch.ones(1))
    else:
        with pytest.raises(ValueError, match="tensor t5: dtype torch.complex128 cannot be "
                                             "written to safetensors"):
            writer.add("t5", bad)
    assert all(p.name.endswith(".partial") for p in tmp_path.iterdir())
    writer.add("t6", torch.ones(3))  # the failed add left the writer as it was
    writer.close()
    assert sorted(read_folder(tmp_path)[0]) == ["t0", "t1", "t2", "t3", "t4", "t6"]


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from megatron.checkpoint.formats.shards import ShardWriter

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    folder = Path(sys.argv[1])
    warm = ShardWriter(folder / "warm", 1 << 30)  # imports and first calls out of the way
    warm.add("w", torch.ones(4).t())
    warm.close()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    writer = ShardWriter(folder / "out", 1 << 30)
    for i in range(12):
        if i % 2:  # a transposed 4096 x 2048 view: the writer makes it contiguous, one copy
            tensor = torch.full((2048, 4096), float(i)).t()
        else:
            tensor = torch.full((8 << 20,), float(i))
        writer.add(f"t{i}", tensor)
        del tensor
    writer.close()
    print(json.dumps({"before": before, "peak": status("VmHWM"), "total": writer.total_bytes}))
""")


def test_memory_holds_a_tensor_not_the_shard(tmp_path):
    """12 tensors of 32 MiB (384 MiB) into one shard (max_bytes 1 GiB), made one at a time and
    dropped: the peak RSS grows by about one tensor (two for a non-contiguous one, which is
    copied), below the 96 MiB of three, where holding the shard would take 384 MiB."""
    (tmp_path / "warm").mkdir()
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["before"]
    print(f"peak RSS growth {growth / MIB:.1f} MiB writing {figures['total'] / MIB:.0f} MiB")
    assert figures["total"] == 12 * 32 * MIB
    assert growth < 3 * 32 * MIB
    assert [p.name for p in (tmp_path / "out").iterdir()] == [SAFE_SINGLE]
    assert (tmp_path / "out" / SAFE_SINGLE).stat().st_size > 12 * 32 * MIB
    with safe_open(str(tmp_path / "out" / SAFE_SINGLE), framework="pt") as f:
        assert set(f.keys()) == {f"t{i}" for i in range(12)}
        for i in (0, 11):
            assert f.get_slice(f"t{i}")[:1].eq(i).all()
