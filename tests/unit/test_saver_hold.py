"""Held saves (megatron/checkpoint/io/saver.py, for the divergence guard): a save made with hold=True
is written but moves the tracker only when confirmed, a second save keeps the held one's folder,
discard leaves nothing of the unconfirmed ones behind, and a save without hold confirms those
before it; synchronous and asynchronous (--async-save), in a one-process gloo group."""

from pathlib import Path

import pytest
import torch


class FilesStep:
    """What the Saver needs of a TrainStep: the files of a save."""

    def capture(self, root, tag, iteration, snapshot_with=None):
        folder = Path(root) / tag
        folder.mkdir(parents=True, exist_ok=True)
        state = {"weights": torch.full((4,), float(iteration))}
        return [(str(folder / "model.pt"), snapshot_with(state) if snapshot_with else state)]


def folders(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


def tracker(root):
    return (root / "latest_checkpointed_iteration.txt").read_text().strip()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_held_saves_commit_on_confirm_and_vanish_on_discard(one_process_group, tmp_path,
                                                            async_save):
    from megatron.checkpoint.io.saver import Saver

    root = tmp_path / "ckpt"
    saver = Saver(FilesStep(), str(root), {}, "cpu", {}, async_save=async_save, timeout_s=60)
    try:
        saver.save(1, 4, {})
        saver.finish()
        assert tracker(root) == "1" and folders(root) == ["iter_0000001"]
        saver.save(2, 8, {}, hold=True)
        saver.finish()  # written: still held
        assert tracker(root) == "1" and folders(root) == ["iter_0000001", "iter_0000002.tmp"]
        saver.confirm()
        assert tracker(root) == "2" and folders(root) == ["iter_0000001", "iter_0000002"]
        assert saver.last["held"]
        saver.save(3, 12, {}, hold=True)
        saver.save(4, 16, {}, hold=True)  # a second save keeps the held one's folder
        saver.poll()
        assert saver.discard() == [3, 4]
        assert tracker(root) == "2" and folders(root) == ["iter_0000001", "iter_0000002"]
        saver.save(5, 20, {}, hold=True)
        saver.confirm()  # before the asynchronous writer is done: it commits when written
        saver.save(6, 24, {}, hold=True)
        saver.save(7, 28, {})  # a final save confirms the held ones first
        saver.finish()
        assert tracker(root) == "7"
        assert folders(root) == [f"iter_000000{i}" for i in (1, 2, 5, 6, 7)]
        loaded = torch.load(root / "iter_0000006" / "model.pt", weights_only=True)
        assert loaded["weights"].tolist() == [6.0] * 4
    finally:
        saver.close()
