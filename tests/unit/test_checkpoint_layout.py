"""The names in a checkpoint folder (megatron/checkpoint/layout.py): what the trainer's saves, the
conversion tool's weights checkpoints and the readers of ours and CPM-2's all take from there."""

import pytest

from megatron.checkpoint import layout


def test_iteration_folder_names_are_megatrons():
    assert layout.iteration_folder_name(3) == "iter_0000003"
    assert layout.iteration_folder_name(12345678) == "iter_12345678"
    assert layout.iteration_of_folder("iter_0000003") == 3
    for other in ("iter_0000003.tmp", "iter_0000003.removing", "iter_", "latest", "3"):
        assert layout.iteration_of_folder(other) is None


def test_iteration_folders_are_the_complete_ones_oldest_first(tmp_path):
    for name in ("iter_0000010", "iter_0000002", "iter_0000011.tmp", "iter_0000001.removing"):
        (tmp_path / name).mkdir()
    (tmp_path / "iter_0000005").write_text("a file, not a folder")
    assert layout.iteration_folders(tmp_path) == [(2, tmp_path / "iter_0000002"),
                                                  (10, tmp_path / "iter_0000010")]


def test_write_tracker_then_read_it(tmp_path):
    assert layout.read_tracker(tmp_path) is None
    written = []
    layout.write_tracker(tmp_path, 7, write=lambda path, text: written.append(path.name)
                         or path.write_text(text))
    assert written == [layout.TRACKER, "latest"]  # the tracker first, DeepSpeed's file after
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7\n"
    assert (tmp_path / "latest").read_text() == "iter_0000007"
    assert layout.read_tracker(tmp_path) == 7


@pytest.mark.parametrize("text", ["iter_3", "-3", "+3", "1_000", "3.0", "", "\u00b2"])
def test_a_tracker_without_a_number_is_one_message_naming_it(tmp_path, text):
    (tmp_path / layout.TRACKER).write_text(text)
    with pytest.raises(layout.TrackerError,
                       match=rf"^{tmp_path}/latest_checkpointed_iteration.txt holds .*, not an "
                             rf"iteration number; pass --iteration N$"):
        layout.read_tracker(tmp_path, hint="pass --iteration N")


def test_release_is_taken_only_where_asked(tmp_path):
    (tmp_path / layout.TRACKER).write_text("release\n")
    assert layout.read_tracker(tmp_path, release_ok=True) == layout.RELEASE == "release"
    with pytest.raises(layout.TrackerError, match="says 'release': a Megatron-LM release"):
        layout.read_tracker(tmp_path)


def test_a_long_or_binary_tracker_is_quoted_short(tmp_path):
    (tmp_path / layout.TRACKER).write_bytes(b"\xff" * 10 + b"x" * 100)
    with pytest.raises(layout.TrackerError) as raised:
        layout.read_tracker(tmp_path)
    assert "x" * 30 + "'" in str(raised.value) and "x" * 31 not in str(raised.value)
