"""Checkpoints on the S3 server (`--save s3://...`, `--load s3://...`): a run saved there and
resumed from there has the losses of the same run straight, bit for bit; the tracker object is
written last, so a save that fails before it leaves --load at the previous iteration; wrong
credentials are refused before anything starts."""

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers

from harness import run_workers  # noqa: E402
from train_workers import base_argv, run_pretrain  # noqa: E402

pytestmark = pytest.mark.slow


def _objects(server, bucket):
    return sorted(p.relative_to(server.root / bucket).as_posix()
                  for p in (server.root / bucket).rglob("*") if p.is_file())


def test_a_run_resumed_from_s3_has_the_losses_of_the_run_straight(s3_server, s3_env,
                                                                   train_data, tmp_path):
    s3_server.make_bucket("ckpt-resume")
    url = "s3://ckpt-resume/runs/a"
    run = lambda *extra: base_argv(train_data, "--zero-stage", "1", *extra,  # noqa: E731
                                   model=train_data.tiny_dropout, iters=6)
    staging = ("--checkpoint-staging-path", str(tmp_path / "staging"))
    straight, first, second = run_workers(2, run_pretrain, [
        run(), run("--save", url, "--save-interval", "2", "--exit-interval", "3", *staging),
        run("--save", url, "--load", url, "--async-save", *staging),
    ], timeout=600)[0]
    assert first["iteration"] == 3 and second["iteration"] == 6
    for i in range(1, 7):  # exact float equality: the same bits
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]
    objects = _objects(s3_server, "ckpt-resume")
    assert (s3_server.root / "ckpt-resume/runs/a/latest_checkpointed_iteration.txt"
            ).read_text() == "6\n"
    assert (s3_server.root / "ckpt-resume/runs/a/latest").read_text() == "iter_0000006"
    assert sorted({o.split("/")[2] for o in objects if "/iter_" in o}) == [
        "iter_0000002", "iter_0000003", "iter_0000006"]
    assert "runs/a/iter_0000006/rng/rank_00001.pt" in objects
    assert "runs/a/zero_to_fp32.py" in objects  # DeepSpeed's script, as in a local folder
    assert not any(".write-probe" in o for o in objects)
    # nothing is left in the staging folder but empty folders
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()
                and not p.relative_to(tmp_path / "staging").parts[0].startswith("load-")]
    assert not (Path.cwd() / "s3:").exists()

    # iteration 3 loaded at another layout (TP 2, DP 1): from s3:// as from a local copy of the
    # same objects (io/reshard.py; tests/training/test_load_at_another_layout.py holds the local
    # load against the offline route). Resharded, every saved rank's files are downloaded, once
    # per host: the two ranks share the host's staging folder.
    local = tmp_path / "copy"
    shutil.copytree(s3_server.root / "ckpt-resume/runs/a", local)
    tp2 = ("--tensor-model-parallel-size", "2", "--ckpt-step", "3")
    from_disk, from_s3 = run_workers(2, run_pretrain, [
        run("--load", str(local), *tp2, "--log-file", str(tmp_path / "disk.log")),
        run("--load", url, *tp2, *staging, "--log-file", str(tmp_path / "s3.log")),
    ], timeout=600)[0]
    assert from_s3["losses"] == from_disk["losses"] and sorted(from_s3["losses"]) == [4, 5, 6]
    assert from_s3["evals"] == from_disk["evals"]
    line = "resharding the checkpoint from TP 1 PP 1 DP 2 EP 1 to TP 2 PP 1 DP 1 EP 1"
    assert line in (tmp_path / "s3.log").read_text()
    host = [p for p in (tmp_path / "staging").iterdir() if p.name.startswith("load-")]
    assert len(host) == 1, host  # one folder for the host's two ranks
    staged = sorted(p.name for p in (host[0] / "ckpt-resume/runs/a/iter_0000003").rglob("*.pt"))
    assert staged == sorted(p.name for p in (local / "iter_0000003").rglob("*.pt")
                            if "rng" not in p.parts), staged


def test_wrong_credentials_are_refused_before_start(s3_server, s3_env,
                                                    train_data, monkeypatch, capsys):
    from megatron.pretrain_t5 import main

    s3_server.make_bucket("ckpt-refused")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    argv = base_argv(train_data, "--save", "s3://ckpt-refused/run",
                     "--load", "s3://ckpt-refused/run")
    assert main(argv) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "--save s3://ckpt-refused/run" in text and "wrong secret key" in text, text
    assert "--load s3://ckpt-refused/run" in text, text
    assert _objects(s3_server, "ckpt-refused") == []


class FilesStep:
    """What the Saver needs of a TrainStep: the files of a save (one tensor file)."""

    def capture(self, root, tag, iteration, snapshot_with=None):
        import torch

        folder = Path(root) / tag
        folder.mkdir(parents=True, exist_ok=True)
        state = {"weights": torch.full((1000,), float(iteration))}
        return [(str(folder / "model.pt"), snapshot_with(state) if snapshot_with else state)]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_tracker_is_written_last(s3_server, fault_proxy, one_process_group, tmp_path,
                                     monkeypatch, async_save):
    """A save whose requests fail after its files are uploaded (the server answers 503 from
    then on) fails, and --load still finds the previous iteration, whole; a truncated object
    is named by its key; the next save aborts incomplete multipart uploads and --keep-last
    deletes old iterations' objects, never the tracker's."""
    import torch

    from megatron.checkpoint.io.remote import stage_for_load
    from megatron.checkpoint.io.remote_saver import RemoteSaver
    from megatron.checkpoint.io.saver import SaveFailed
    from megatron.config.training import CheckpointStorage
    from megatron.data.storage.object_storage import ObjectStorageError, StorageSettings

    bucket = s3_server.make_bucket(f"ckpt-commit-{'a' if async_save else 's'}")
    for name, value in s3_server.env(fault_proxy.endpoint).items():
        monkeypatch.setenv(name, value)
    url, on_disk = f"s3://{bucket}/run", s3_server.root / bucket / "run"
    storage = CheckpointStorage(StorageSettings(retries=3, timeout_s=120, backoff_s=0.01),
                                str(tmp_path / "staging"), part_size_mb=5,
                                upload_concurrency=4)
    saver = RemoteSaver(FilesStep(), url, {}, "cpu", {}, keep_last=1, async_save=async_save,
                        timeout_s=60, storage=storage)
    confirm = saver.remote.confirm

    def confirm_then_fail(sizes):  # every later request of this save answers 503
        confirm(sizes)
        fault_proxy.answer_503_next(1000)
        fault_proxy.reset()  # the kept-alive connections too

    try:
        saver.save(1, 4, {})
        saver.finish()
        assert (on_disk / "latest_checkpointed_iteration.txt").read_text() == "1\n"
        saver.remote.confirm = confirm_then_fail
        with pytest.raises(SaveFailed, match="the tracker still names the previous"):
            saver.save(2, 8, {})
            saver.finish()
        fault_proxy.clear()
        saver.remote.confirm = confirm
        # uploaded, but neither meta.json nor the tracker moved
        assert (on_disk / "iter_0000002" / "model.pt").is_file()
        assert not (on_disk / "iter_0000002" / "meta.json").exists()
        assert (on_disk / "latest_checkpointed_iteration.txt").read_text() == "1\n"
        assert (on_disk / "latest").read_text() == "iter_0000001"
        every = lambda name, meta: True  # noqa: E731
        root = stage_for_load(url, storage, None, (0, 0, 0), every, lambda x: x)
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "1\n"
        loaded = torch.load(root / "iter_0000001" / "model.pt", weights_only=True)
        assert loaded["weights"].tolist() == [1.0] * 1000

        # a job killed mid-upload leaves a multipart upload: the next save aborts it
        client = s3_server.client()
        client.create_multipart_upload(Bucket=bucket, Key="run/iter_0000003/model.pt")
        saver.save(3, 12, {})
        saver.finish()
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
        assert (on_disk / "latest_checkpointed_iteration.txt").read_text() == "3\n"
        assert sorted(p.name for p in on_disk.glob("iter_*")) == ["iter_0000003"]
    finally:
        saver.close()
    # a truncated object: one message naming its key
    model = on_disk / "iter_0000003" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    with pytest.raises(ObjectStorageError, match=f"{url}/iter_0000003/model.pt has 100 bytes"):
        stage_for_load(url, storage, None, (0, 0, 0), every, lambda x: x)


def test_an_s3_load_that_contradicts_the_flags_is_refused_before_start(
        s3_server, s3_env, train_data, tmp_path, capsys):
    """meta.json of an s3:// --load is read before start, as a local folder's: another learning
    rate than the checkpoint's (without --override-lr-scheduler) is one message naming the
    --load and the field, exit 2, before any process group; --ckpt-step naming an iteration
    the prefix does not hold too. The same flags with the checkpoint's learning rate pass."""
    from megatron.arguments import ArgumentsError, parse_args
    from megatron.pretrain_t5 import main

    bucket = s3_server.make_bucket("ckpt-contradicts")
    local = tmp_path / "ckpt"
    run_workers(1, run_pretrain, [base_argv(train_data, "--save", str(local), iters=2)],
                timeout=300)
    shutil.copytree(local, s3_server.root / bucket / "run")
    url = f"s3://{bucket}/run"
    argv = base_argv(train_data, "--load", url, "--checkpoint-staging-path",
                     str(tmp_path / "staging"), iters=2)
    assert main([*argv, "--lr", "1e-2"]) == 2
    text = "".join(capsys.readouterr())
    assert f"--load {url}" in text and "learning-rate schedule in the checkpoint" in text, text
    assert "lr: flags 0.01 vs checkpoint 0.003" in text, text
    assert main([*argv, "--ckpt-step", "5"]) == 2
    text = "".join(capsys.readouterr())
    assert f"{url}/iter_0000005/meta.json is missing" in text, text
    with pytest.raises(ArgumentsError):  # the local folder's check says the same
        parse_args([*base_argv(train_data, "--load", str(local), iters=2), "--lr", "1e-2"],
                   env={})
    assert parse_args(argv, env={}).checkpoint.load == url
