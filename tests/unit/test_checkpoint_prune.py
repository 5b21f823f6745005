"""checkpointing.prune (--keep-last): only complete checkpoints older than the newest N go, never
the tracker's, never a folder being written; a removal cut short leaves no folder that looks
like a checkpoint."""

from megatron.checkpoint.io.checkpointing import prune
from megatron.checkpoint.layout import TRACKER


def make(root, *names):
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "meta.json").write_text("{}")


def names(root):
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_keeps_the_newest(tmp_path):
    make(tmp_path, "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004")
    (tmp_path / TRACKER).write_text("4\n")
    removed = prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000002"]
    assert names(tmp_path) == ["iter_0000003", "iter_0000004"]


def test_never_the_trackers_nor_one_being_written(tmp_path):
    # the tracker names an older checkpoint (a run resumed from it has not saved yet)
    make(tmp_path, "iter_0000002", "iter_0000005", "iter_0000006", "iter_0000007.tmp")
    (tmp_path / TRACKER).write_text("2\n")
    prune(tmp_path, 1)
    assert names(tmp_path) == ["iter_0000002", "iter_0000006", "iter_0000007.tmp"]


def test_an_interrupted_removal_is_finished(tmp_path):
    make(tmp_path, "iter_0000001.removing", "iter_0000003")
    (tmp_path / TRACKER).write_text("3\n")
    assert prune(tmp_path, 1) == []
    assert names(tmp_path) == ["iter_0000003"]
