"""Checkpoints on the S3 server (`--save s3://...`, `--load s3://...`): a run saved there and
resumed from there has the losses of the same run straight, bit for bit; the tracker object is
written last, so a save that fails before it leaves --load at the previous iteration; wrong
credentials are refused before anything starts."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers

from harness import run_workers  # noqa: E402
from train_workers import base_argv, run_pretrain, run_pretrain_until_error  # noqa: E402

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
        run(), run("--save", url, "--save-interval", "2", "--exit-interval", "3",
                   "--keep-last", "1", *staging),
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
    # --keep-last 1 deleted iteration 2 once 3 was committed; the second run keeps all
    assert sorted({o.split("/")[2] for o in objects if "/iter_" in o}) == [
        "iter_0000003", "iter_0000006"]
    assert "runs/a/iter_0000006/rng/rank_00001.pt" in objects
    assert not any(".write-probe" in o for o in objects)
    # nothing is left in the staging folder but empty folders
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()
                and "load-rank" not in str(p)]
    assert not (Path.cwd() / "s3:").exists()


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
