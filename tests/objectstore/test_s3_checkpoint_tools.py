"""The checkpoint tools on the S3 server: `convert_checkpoint.py --load s3://... --to X` writes
what it writes from the local folder (byte for byte, but meta.json's time and source path),
`--inspect s3://...` prints the local text (the URL for the path), `--to megatron s3://...`
uploads the local conversion (meta.json adds its manifest; the tracker objects last), and
`python -m megatron.generate --load s3://... --prompt-load s3://...` decodes the local ids, and
the trainer's prompt tuning on an s3:// base from an s3:// prompt is the local run. A checkpoint
copied up by hand (no manifest) reads as its listing. A truncated or missing object and refused
credentials are one message naming the key or the flag, exit 2, before anything is written; an
upload that fails leaves no tracker."""

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers

from harness import run_workers  # noqa: E402
from train_workers import base_argv, run_pretrain  # noqa: E402

from data_tools import convert_checkpoint  # noqa: E402
from megatron import generate  # noqa: E402

pytestmark = pytest.mark.slow

BUCKET = "tools"
PROMPT = ["--prompt-tune", "--prompt-length", "4", "--prompt-positions", "0.5,0.5",
          "--prompt-init-token", "random"]


@pytest.fixture(scope="module")
def ckpts(train_data, tmp_path_factory):
    """Local checkpoints of a 2-step ZeRO-1 run (base) and of a prompt tuned on it (prompt)."""
    root = tmp_path_factory.mktemp("tools")
    f = {n: root / n for n in ("base", "prompt")}
    run = lambda *extra: base_argv(train_data, "--zero-stage", "1", *extra,  # noqa: E731
                                   iters=2)
    run_workers(1, run_pretrain, [
        run("--save", str(f["base"])),
        run("--load", str(f["base"]), "--finetune", "--save", str(f["prompt"]), *PROMPT,
            "--lr", "0.05"),
    ], timeout=600)
    return f


@pytest.fixture
def on_s3(s3_server, s3_env, ckpts, tmp_path, monkeypatch):
    """name -> the s3:// URL of that local checkpoint, copied onto the server (objects are
    plain files there); the staging folder under tmp_path."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # (the training workers')
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # (this process's, cached)
    (tmp_path / "tmp").mkdir()
    s3_server.make_bucket(BUCKET)
    urls = {}
    for name, local in ckpts.items():
        prefix = f"{tmp_path.name}/{name}"
        shutil.copytree(local, s3_server.root / BUCKET / prefix)
        urls[name] = f"s3://{BUCKET}/{prefix}"
    return urls


def _files(folder):
    return {p.relative_to(folder).as_posix(): p for p in sorted(Path(folder).rglob("*"))
            if p.is_file()}


def _meta(path, drop=()):
    """meta.json without what differs between two conversions of one checkpoint: the time and
    the source's path (and `drop`)."""
    meta = json.loads(Path(path).read_text())
    meta.pop("saved_at", None)
    (meta.get("source") or {}).pop("path", None)
    for key in drop:
        meta.pop(key, None)
    return meta


def assert_same_folder(got, want, drop=()):
    got, want = _files(got), _files(want)
    assert sorted(got) == sorted(want)
    for name, path in want.items():
        if name.endswith("meta.json"):
            assert _meta(got[name], drop) == _meta(path, drop), name
        else:
            assert got[name].read_bytes() == path.read_bytes(), name


def _convert(*argv):
    return convert_checkpoint.main([*argv, "--no-progress"])


CPM2 = ("--num-experts", "2", "--moe-router-type", "cpm2")  # CPM-2-MoE's layout: upcycled


@pytest.mark.parametrize("kind", ["hf", "megatron", "fp32", "cpm2"])
def test_a_conversion_from_s3_writes_the_local_ones(kind, ckpts, on_s3, tmp_path, capsys):
    local, remote = tmp_path / "local", tmp_path / "remote"
    extra = CPM2 if kind == "cpm2" else ()
    assert _convert("--load", str(ckpts["base"]), "--to", kind, str(local), *extra) == 0
    assert _convert("--load", on_s3["base"], "--to", kind, str(remote), *extra) == 0, \
        capsys.readouterr().err
    assert_same_folder(remote, local)
    if kind in ("megatron", "fp32"):
        source = json.loads(next(remote.glob("iter_*/meta.json")).read_text())["source"]
        assert source["path"] == on_s3["base"] + "/iter_0000002"
    assert not list((tmp_path / "tmp" / f"t5-pretrain-staging-{os.getuid()}").iterdir())


def test_inspect_of_s3_prints_the_local_text(ckpts, on_s3, capsys):
    assert _convert("--inspect", str(ckpts["base"])) == 0
    local = capsys.readouterr().out
    assert _convert("--inspect", on_s3["base"]) == 0
    remote = capsys.readouterr().out
    assert json.loads(remote)["path"] == on_s3["base"] + "/iter_0000002"
    assert remote.replace(on_s3["base"], str(ckpts["base"])) == local


def test_to_megatron_s3_uploads_the_local_conversion(s3_server, ckpts, on_s3, tmp_path,
                                                     capsys):
    local = tmp_path / "local"
    url = f"s3://{BUCKET}/{tmp_path.name}/tp2"
    flags = ("--target-tensor-parallel-size", "2")
    assert _convert("--load", str(ckpts["base"]), "--to", "megatron", str(local), *flags) == 0
    assert _convert("--load", on_s3["base"], "--to", "megatron", url, *flags) == 0
    out = capsys.readouterr().out
    assert f"wrote {url} with the optimizer states" in out and "the tracker last" in out, out
    uploaded = s3_server.root / BUCKET / tmp_path.name / "tp2"
    assert_same_folder(uploaded, local, drop=["file_sizes"])
    meta = json.loads((uploaded / "iter_0000002/meta.json").read_text())
    assert meta["file_sizes"] == {name: path.stat().st_size for name, path in
                                  _files(uploaded / "iter_0000002").items()
                                  if name != "meta.json"}
    # the local conversion copied up by hand (no file_sizes: its listing is the checkpoint)
    shutil.copytree(local, s3_server.root / BUCKET / tmp_path.name / "copied")
    copied = f"s3://{BUCKET}/{tmp_path.name}/copied"
    assert _convert("--load", str(local), "--to", "fp32", str(tmp_path / "fp32_local")) == 0
    assert _convert("--load", copied, "--to", "fp32", str(tmp_path / "fp32_copied")) == 0
    assert_same_folder(tmp_path / "fp32_copied", tmp_path / "fp32_local")
    capsys.readouterr()
    # a second conversion there is refused without --force, before anything is written
    assert _convert("--load", on_s3["base"], "--to", "megatron", url) == 2
    assert f"--to megatron {url}: objects exist under that prefix; pass --force" in \
        capsys.readouterr().err
    # other formats are local folders only
    assert _convert("--load", on_s3["base"], "--to", "hf", url) == 2
    assert "--to hf takes a local path" in capsys.readouterr().err


def _generate(tmp_path, capsys, name, *extra):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                           ["To be, or not to be", "The king"]), encoding="utf-8")
    out = tmp_path / f"{name}.jsonl"
    code = generate.main(["--input", str(inp), "--output", str(out), "--max-new-tokens", "6",
                          *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    return [json.loads(line)["ids"] for line in out.read_text().splitlines()]


def test_generate_from_s3_decodes_the_local_ids(train_data, ckpts, on_s3, tmp_path, capsys):
    spm = ("--tokenizer-model", train_data.spm)
    local = _generate(tmp_path, capsys, "local", "--load", str(ckpts["base"]),
                      "--prompt-load", str(ckpts["prompt"]), *spm)
    remote = _generate(tmp_path, capsys, "remote", "--load", on_s3["base"],
                       "--prompt-load", on_s3["prompt"], *spm)
    plain = _generate(tmp_path, capsys, "plain", "--load", on_s3["base"], *spm)
    assert remote == local and plain != local  # the prompt was read
    assert not list((tmp_path / "tmp" / f"t5-pretrain-staging-{os.getuid()}").iterdir())


def test_a_truncated_object_or_refused_credentials_are_named(s3_server, on_s3, tmp_path,
                                                            capsys, monkeypatch):
    victim = s3_server.root / BUCKET / tmp_path.name / "base/iter_0000002"
    model = next(p for p in sorted(victim.iterdir()) if p.name.endswith("model_states.pt"))
    model.write_bytes(model.read_bytes()[:100])
    out = tmp_path / "out"
    key = f"{on_s3['base']}/iter_0000002/{model.name}"
    assert _convert("--load", on_s3["base"], "--to", "fp32", str(out)) == 2
    assert f"--load {on_s3['base']}: {key} has 100 bytes" in capsys.readouterr().err
    assert not out.exists()
    rng = s3_server.root / BUCKET / tmp_path.name / "prompt/iter_0000002/rng/rank_00000.pt"
    rng.unlink()
    assert _convert("--inspect", on_s3["prompt"]) == 2
    assert f"--inspect {on_s3['prompt']}: {on_s3['prompt']}/iter_0000002/rng/rank_00000.pt " \
        f"is missing" in capsys.readouterr().err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert _convert("--inspect", on_s3["prompt"]) == 2
    err = capsys.readouterr().err
    assert f"--inspect {on_s3['prompt']}" in err and "access denied" in err, err


def test_prompt_tuning_on_an_s3_base_from_an_s3_prompt(train_data, ckpts, on_s3, tmp_path):
    """The trainer's --load s3://BASE --finetune --prompt-tune --prompt-load s3://PROMPT: the
    run of the local folders, loss for loss, and the same base identity recorded (the digest of
    the base checkpoint's full tensors, not of the model in memory)."""
    from megatron.checkpoint.formats.deepspeed import find_iteration, read_meta

    def run(base, prompt, save):
        return base_argv(train_data, "--zero-stage", "1", "--load", base, "--finetune",
                         "--save", str(save), *PROMPT, "--prompt-load", prompt, "--lr", "0.05",
                         iters=2)

    staging = tmp_path / "staging"
    local, remote = run_workers(1, run_pretrain, [
        run(str(ckpts["base"]), str(ckpts["prompt"]), tmp_path / "local"),
        run(on_s3["base"], on_s3["prompt"], tmp_path / "remote") +
        ["--checkpoint-staging-path", str(staging)]], timeout=600)[0]
    assert remote["losses"] == local["losses"]
    bases = [read_meta(find_iteration(tmp_path / name))["model"]["prompt_base"]
             for name in ("local", "remote")]
    assert bases[1]["load"] == on_s3["base"]
    # the load's own staged files stay (until the next load); the digest's download is gone
    assert sorted(p.name for p in staging.iterdir()) == [f"load-{socket.gethostname()}"]
    assert [(b["digest"], b.get("of")) for b in bases[1:]] == \
        [(b["digest"], b.get("of")) for b in bases[:1]]


def test_an_upload_that_fails_leaves_no_tracker(ckpts, on_s3, s3_server, tmp_path, capsys,
                                                monkeypatch):
    """--to megatron s3://: an object the server does not confirm stops the upload before the
    tracker objects (exit 1, the key named): --load there finds no checkpoint."""
    from megatron.checkpoint.io.remote import RemoteFolder
    from megatron.data.storage.object_storage import ObjectStorageError

    def short(self, sizes):
        key = self.url_of(sorted(sizes)[0])
        raise ObjectStorageError(f"{key} has 1 bytes, the save wrote {sorted(sizes.values())[0]}")

    confirm = RemoteFolder.confirm
    monkeypatch.setattr(RemoteFolder, "confirm", short)
    url = f"s3://{BUCKET}/{tmp_path.name}/failed"
    assert _convert("--load", str(ckpts["base"]), "--to", "megatron", url) == 1
    assert f"error: {url}/" in capsys.readouterr().err
    monkeypatch.setattr(RemoteFolder, "confirm", confirm)
    uploaded = s3_server.root / BUCKET / tmp_path.name / "failed"
    assert uploaded.is_dir() and not (uploaded / "latest_checkpointed_iteration.txt").exists()
    assert not (uploaded / "latest").exists()
    assert _convert("--inspect", url) == 2
    assert f"{url}/latest_checkpointed_iteration.txt is missing" in capsys.readouterr().err


def test_iteration_and_flag_checks_of_generate(train_data, on_s3, tmp_path, capsys):
    assert _convert("--inspect", on_s3["base"], "--iteration", "1") == 2
    assert f"{on_s3['base']}/iter_0000001/meta.json is missing; the iterations saved there: 2" \
        in capsys.readouterr().err
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"text": "a"}) + "\n")
    argv = ["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--tokenizer-model",
            train_data.spm]
    assert generate.main(["--load", str(tmp_path), "--checkpoint-staging-path", "x", *argv]) == 2
    assert "--checkpoint-staging-path has effect only with an s3:// --load / --prompt-load" in \
        capsys.readouterr().err
    assert generate.main(["--load", on_s3["base"], "--iteration", "1", *argv]) == 2
    assert f"--load {on_s3['base']}: {on_s3['base']}/iter_0000001/meta.json is missing" in \
        capsys.readouterr().err


def test_evaluate_from_s3_scores_as_from_the_local_folder(train_data, ckpts, on_s3, tmp_path):
    """megatron.evaluate's model (load_lm, what `--load s3://... --prompt-load s3://...`
    builds) answers the harness's requests as the local folders' does, the staging emptied."""
    from lm_eval.api.instance import Instance

    from megatron.evaluate import load_lm

    requests = [Instance("loglikelihood", {}, ("To be, or not to ", "be"), 0),
                Instance("loglikelihood", {}, ("The king", " is dead"), 1)]
    answers = {}
    for name, load, prompt in (("local", str(ckpts["base"]), str(ckpts["prompt"])),
                               ("remote", on_s3["base"], on_s3["prompt"]),
                               ("plain", on_s3["base"], None)):
        lm = load_lm(load, train_data.spm, prompt_load=prompt)
        answers[name] = lm.loglikelihood(requests)
    assert answers["remote"] == answers["local"] and answers["plain"] != answers["local"]
    assert not list((tmp_path / "tmp" / f"t5-pretrain-staging-{os.getuid()}").iterdir())
