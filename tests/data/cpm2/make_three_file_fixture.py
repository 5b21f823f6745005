"""Make tests/data/cpm2/three_files/ with CPM-2-Pretrain's own code (none of ours).

    python tests/data/cpm2/make_three_file_fixture.py --cpm2-src /tmp/cpm2 \
        --out tests/data/cpm2/three_files

1. A small corpus taken from tests/data/corpora (see `corpus_documents`) is written one document
   per line, newlines as CPM-2's `<n>`, and CPM-2's `src/tools/preprocess_data_enc_dec.py` runs
   on it as its own program (`--workers 1`, the bpe_cn vocabulary of tests/data/cpm2/bpe_cn):
   `zh_mix_document_{context,target,target_offset}.{bin,idx}`.
2. CPM-2's `src/data/enc_dec_dataset.py` reads those files back through
   `build_train_valid_test_datasets`, called as `src/pretrain_enc_dec.py` calls it. For each
   configuration in CONFIGS, every window of the train and valid splits is recorded (the
   dataset's four fields and the masks `get_masks_and_position_ids` of `src/pretrain_enc_dec.py`
   makes for them), with the dataset's doc_idx / sample_idx / shuffle_idx: `reference.npz`
   (keys CONFIG/SPLIT/FIELD) described by `reference.json`.

Only what cannot run with today's torch / numpy or outside CPM-2's cluster setup is replaced
(STAND_INS and `install_stand_ins`; README.md there lists it): their `utils` and `mpu` modules
(print_rank_0 and get_data_parallel_group only), numpy's removed `np.float` alias, `six` where it
is not installed, `torch.cuda.LongTensor` (their index barrier, run on the CPU), the
never-compiled `data.helpers` (helpers.cpp compiled here with their Makefile's flags); and
`get_masks_and_position_ids` runs on its own, cut out of pretrain_enc_dec.py (which imports apex
and their model).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
from pathlib import Path
from typing import Dict, List

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PREFIX = "zh_mix"  # CPM-2's tool appends "_document"
SPLITS = ("train", "valid")
CONFIGS = (
    # CPM-2's own pretraining lengths (src/scripts/pretrain_enc_dec.sh) and default seed.
    {"name": "enc512_dec256", "enc_seq_length": 512, "dec_seq_length": 256, "seed": 1234,
     "split": "949,50,1", "num_samples": [24, 4, 0]},
    # Short windows: many windows across documents, and decoder sequences cut to 16 + 1.
    {"name": "enc64_dec16", "enc_seq_length": 64, "dec_seq_length": 16, "seed": 7,
     "split": "949,50,1", "num_samples": [64, 8, 0]},
)
THEIR_SOURCES = ("src/tools/preprocess_data_enc_dec.py", "src/data/enc_dec_dataset.py",
                 "src/data/indexed_dataset.py", "src/data/helpers.cpp",
                 "src/tokenization_enc_dec.py", "src/pretrain_enc_dec.py")


def corpus_documents(corpora: Path) -> List[str]:
    """One short line first (fewer than 10 tokens: CPM-2's tool drops it), two English passages,
    then Chinese Wikipedia paragraphs (several with Latin names and numbers) alternating with
    Chinese stories; every document cut to its first 600 characters."""

    def first(name: str, count: int, chars: int) -> List[str]:
        out = []
        with open(corpora / name, encoding="utf-8") as f:
            for line in f:
                if len(out) == count:
                    break
                out.append(json.loads(line)["text"][:chars])
        return out

    english = first("en_shakespeare.jsonl", 2, 500)
    wiki = first("zh_cmrc2018_wiki.jsonl", 12, 600)
    stories = first("zh_cmrc2019_stories.jsonl", 12, 600)
    docs = [english[0].split("\n")[0]] + english
    for w, s in zip(wiki, stories):
        docs += [w, s]
    return docs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def stdout_silenced():
    """Their C++ helper and dataset print to stdout; keep ours readable."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


STAND_INS = {
    # their utils.py imports fp16 -> mpu -> torch._six (gone since torch 2.0), apex, deepspeed
    "utils.py": "def print_rank_0(*args, **kwargs):\n    pass\n",
    # their mpu builds model-parallel groups on CUDA; the data code only asks for this group
    "mpu.py": "def get_data_parallel_group():\n    return None  # the default group\n",
    # their indexed_dataset.py names np.float (removed in numpy 1.24), an alias of float
    "sitecustomize.py": "import numpy\nif 'float' not in vars(numpy):\n    numpy.float = float\n",
}


def stand_in_dir(tmp: Path) -> Path:
    """A folder of modules that shadow CPM-2's (STAND_INS; `six`, which their tokenizer
    imports for PY2 / PY3 only, where it is not installed)."""
    stubs = tmp / "stand_ins"
    stubs.mkdir(exist_ok=True)
    modules = dict(STAND_INS)
    if importlib.util.find_spec("six") is None:
        modules["six.py"] = "PY2 = False\nPY3 = True\n"
    for name, text in modules.items():
        (stubs / name).write_text(text)
    return stubs


def run_their_preprocessing(cpm2: Path, corpus: Path, vocab_dir: Path, out: Path,
                            tmp: Path) -> List[str]:
    """Run preprocess_data_enc_dec.py as a program; returns the command line."""
    argv = [sys.executable, str(cpm2 / "src/tools/preprocess_data_enc_dec.py"),
            "--input", str(corpus), "--tokenizer_path", str(vocab_dir),
            "--output_path", str(out), "--output_prefix", PREFIX, "--workers", "1"]
    env = dict(os.environ)
    # Their script appends src/ to sys.path, so the stand-ins on PYTHONPATH come first.
    env["PYTHONPATH"] = os.pathsep.join([str(stand_in_dir(tmp)), env.get("PYTHONPATH", "")]
                                        ).strip(os.pathsep)
    # Its tokenizer prints every token list to stdout.
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=tmp)
    if done.returncode != 0:
        sys.exit(f"CPM-2's preprocess_data_enc_dec.py failed:\n{done.stderr[-3000:]}")
    return argv


def compile_their_helpers(cpp: Path, tmp: Path) -> Path:
    """helpers.cpp as src/data/Makefile builds it (their compile_helper() never does)."""
    import pybind11

    so = tmp / ("helpers" + sysconfig.get_config_var("EXT_SUFFIX"))
    cxx = os.environ.get("CXX", "g++")
    cmd = [cxx, "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", f"-I{pybind11.get_include()}",
           f"-I{sysconfig.get_paths()['include']}", str(cpp), "-o", str(so)]
    subprocess.run(cmd, check=True)
    return so


def install_stand_ins(torch, tmp: Path) -> None:
    """The stand-in modules first on sys.path (and what sitecustomize does for the program);
    `torch.cuda.LongTensor` (their index barrier's all_reduce) on the CPU."""
    sys.path.insert(0, str(stand_in_dir(tmp)))
    if "float" not in vars(np):
        np.float = float
    torch.cuda.LongTensor = lambda data: torch.tensor(data, dtype=torch.long)


def their_function(path: Path, name: str, namespace: Dict) -> object:
    """One top-level function of a CPM-2 file, executed alone in `namespace`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def record_reference(cpm2: Path, data_dir: Path, vocab: Path, tmp: Path) -> Dict:
    """Every window of CPM-2's train and valid datasets for each of CONFIGS."""
    import torch

    src = cpm2 / "src"
    sys.path.insert(0, str(src))
    install_stand_ins(torch, tmp)
    spec = importlib.util.spec_from_file_location(
        "data.helpers", compile_their_helpers(src / "data/helpers.cpp", tmp))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    import data as their_data  # CPM-2's src/data package

    sys.modules["data.helpers"] = their_data.helpers = helpers
    from data.enc_dec_dataset import build_train_valid_test_datasets, get_train_valid_test_split_
    from tokenization_enc_dec import EncDecTokenizer

    masks_and_positions = their_function(src / "pretrain_enc_dec.py",
                                         "get_masks_and_position_ids",
                                         {"torch": torch, "EncDecTokenizer": EncDecTokenizer})
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0,
                                         world_size=1)
    tokenizer = EncDecTokenizer(str(vocab))
    args = types.SimpleNamespace(fp16=False)
    work = tmp / "work"  # their index maps are written next to the data
    work.mkdir()
    for f in data_dir.iterdir():
        shutil.copy(f, work / f.name)
    prefix = str(work / f"{PREFIX}_document")
    arrays, meta = {}, {}
    for config in CONFIGS:
        with stdout_silenced():
            datasets = build_train_valid_test_datasets(
                tokenizer=tokenizer, data_prefix=prefix, data_impl="mmap",
                splits_string=config["split"],
                train_valid_test_num_samples=config["num_samples"],
                enc_seq_length=config["enc_seq_length"],
                dec_seq_length=config["dec_seq_length"], seed=config["seed"], skip_warmup=True)
        n_docs = int(datasets[0].context_indexed_dataset.sizes.shape[0])
        bounds = get_train_valid_test_split_(config["split"], n_docs)
        meta[config["name"]] = {**config, "documents": n_docs, "splits": {}}
        for s, split in enumerate(SPLITS):
            ds = datasets[s]
            with stdout_silenced():
                samples = [ds[i] for i in range(len(ds))]
            batch = {k: torch.tensor(np.stack([x[k] for x in samples]), dtype=torch.long)
                     for k in ("contexts", "targets", "labels", "ctx_eod_mask")}
            model_b, no_model_b = masks_and_positions(
                args, tokenizer, batch["contexts"], batch["targets"], batch["labels"],
                batch["ctx_eod_mask"], False, False)
            key = f"{config['name']}/{split}/"
            for k, v in batch.items():  # ids < 65536 (CPM-2 stores uint16)
                arrays[key + k] = v.numpy().astype(np.uint16)
            arrays[key + "loss_mask"] = no_model_b["loss_mask"].numpy().astype(np.uint8)
            # Without the reset flags these do not depend on the window: kept once, after
            # checking that every window has the same.
            for k in ("enc_attention_mask", "dec_attention_mask", "cross_attention_mask",
                      "enc_position_ids", "dec_position_ids"):
                v = (model_b[k][:, 0] if k.endswith("mask") else model_b[k]).numpy()
                if not (v == v[:1]).all():
                    sys.exit(f"{key}{k} differs between windows; store it per window")
                arrays[key + k] = v[0].astype(np.uint8 if k.endswith("mask") else np.int32)
            arrays[key + "doc_idx"] = np.asarray(ds.doc_idx, dtype=np.int32)
            arrays[key + "sample_idx"] = np.asarray(ds.sample_idx, dtype=np.int32)
            arrays[key + "shuffle_idx"] = np.asarray(ds.shuffle_idx, dtype=np.int32)
            meta[config["name"]]["splits"][split] = {
                "documents": [int(bounds[s]), int(bounds[s + 1])],
                "num_samples": config["num_samples"][s], "windows": len(ds)}
    torch.distributed.destroy_process_group()
    return {"arrays": arrays, "meta": meta,
            "special_ids": {"vocab_size": tokenizer.vocab_size, "pad": tokenizer.pad_id,
                            "eod": tokenizer.eod_id, "decoder_start": 1,
                            "sentinel_0": tokenizer.get_sentinel_id(0),
                            "sentinels": tokenizer.get_sentinel_num()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpm2-src", required=True, type=Path,
                   help="an unpacked CPM-2-Pretrain (the folder holding src/ and bpe_cn/)")
    p.add_argument("--out", required=True, type=Path, help="the fixture folder to (re)write")
    p.add_argument("--corpora", type=Path, default=REPO / "tests/data/corpora")
    p.add_argument("--vocab-dir", type=Path, default=HERE / "bpe_cn",
                   help="the folder holding CPM-2's bpe_cn vocab.txt")
    args = p.parse_args(argv)
    cpm2 = args.cpm2_src.resolve()
    vocab = args.vocab_dir.resolve() / "vocab.txt"
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        docs = corpus_documents(args.corpora)
        corpus = tmp / "corpus.txt"
        corpus.write_text("".join(d.replace("\n", "<n>") + "\n" for d in docs),
                          encoding="utf-8")
        data_dir = tmp / "data"
        data_dir.mkdir()
        command = run_their_preprocessing(cpm2, corpus, vocab.parent, data_dir, tmp)
        ref = record_reference(cpm2, data_dir, vocab, tmp)
        args.out.mkdir(parents=True, exist_ok=True)
        files = {}
        for f in sorted(data_dir.iterdir()):
            shutil.copy(f, args.out / f.name)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    np.savez_compressed(args.out / "reference.npz", **ref["arrays"])
    info = {
        "made_by": "tests/data/cpm2/make_three_file_fixture.py (see README.md here)",
        "prefix": f"{PREFIX}_document",
        "corpus": {"documents_in": len(docs),
                   "characters": sum(len(d) for d in docs),
                   "selection": " ".join(corpus_documents.__doc__.split())},
        "preprocess_command": " ".join(
            [Path(command[0]).name, "CPM2/src/tools/preprocess_data_enc_dec.py"] + [
                "CORPUS" if a == command[3] else "VOCAB_DIR" if a == command[5] else
                "OUT" if a == command[7] else a for a in command[2:]]),
        "cpm2_sources_sha256": {s: sha256(cpm2 / s) for s in THEIR_SOURCES},
        "files": files, "special_ids": ref["special_ids"], "configs": ref["meta"],
        "fields": "per CONFIG/SPLIT: contexts, targets (decoder input), labels, ctx_eod_mask "
                  "[windows, length] as EncDecDataset returns them for index 0..windows-1; "
                  "loss_mask [windows, dec length] from get_masks_and_position_ids (fp16 off, no "
                  "--reset-position-ids / --reset-attention-mask), and from it, once (the same "
                  "for every window): enc/dec/cross_attention_mask [rows, columns], "
                  "enc/dec_position_ids [length]; doc_idx, sample_idx, shuffle_idx of the "
                  "dataset",
    }
    (args.out / "reference.json").write_text(json.dumps(info, indent=1, ensure_ascii=False)
                                             + "\n", encoding="utf-8")
    total = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"wrote {args.out}: {len(files)} data files, reference.npz, reference.json "
          f"({total / 1024:.1f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
