"""A command line that cannot be parsed (megatron/cli.py): one line per problem, on the rank
that speaks for the job, exit status 2, in every entry point and tool; the table of renamed
Megatron-LM / CPM-2 flags and docs/migrating.md name the same flags and replacements."""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path

import pytest

from megatron.arguments import build_parser
from megatron.cli import RENAMED_FLAGS, refuse

REPO = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"`(--[A-Za-z0-9_-]+)`")  # a whole flag, not `--no-load-*`


def migrating_rows():
    """(left cell, right cell) of every table row of docs/migrating.md."""
    rows = []
    for line in (REPO / "docs" / "migrating.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and not set(cells[0]) <= set("- "):
            rows.append((cells[0], cells[1]))
    return rows


def test_the_renamed_flags_are_the_ones_docs_migrating_md_maps():
    accepted = set(build_parser()._option_string_actions)
    rows = migrating_rows()
    doc_refused = {flag for left, _ in rows for flag in FLAG.findall(left)} - accepted
    assert doc_refused == set(RENAMED_FLAGS)  # the doc's refused flags: the table's, no more
    assert not set(RENAMED_FLAGS) & accepted
    for flag, advice in RENAMED_FLAGS.items():
        right = next(r for left, r in rows if f"`{flag}`" in left)
        for named in re.findall(r"--[a-z0-9-]+", advice):  # the replacement the doc gives
            assert f"`{named}" in right, (flag, named, right)
            assert named in accepted, named


ENTRY_POINTS = ["megatron.pretrain_t5", "megatron.generate", "megatron.plan.__main__", "megatron.plot.__main__",
                "data_tools.preprocess_data", "data_tools.convert_checkpoint",
                "data_tools.inspect_dataset", "data_tools.merge_datasets",
                "data_tools.train_tokenizer", "data_tools.train_punkt",
                "data_tools.make_demo_corpus", "data_tools.make_flags_doc"]
TRAINER_FLAGS = ("megatron.pretrain_t5", "megatron.plan.__main__")  # they take Megatron's flag names


def refusal(module: str, argv, capsys) -> tuple:
    """(exit status, stderr lines) of `module`'s main on argv."""
    try:
        status = importlib.import_module(module).main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_unknown_flags_get_one_line_each_and_exit_2(module, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    status, err = refusal(module, ["--use-distributed-optimizer", "--lr-decay", "1"], capsys)
    assert status == 2, err
    assert not any("usage:" in line for line in err), err
    renamed = [line for line in err if "--use-distributed-optimizer" in line]
    typo = [line for line in err if "unknown flag --lr-decay" in line]
    assert len(renamed) == 1 and len(typo) == 1, err
    if module in TRAINER_FLAGS:
        assert "use --zero-stage 1 or higher (docs/migrating.md)" in renamed[0]
    if module == "megatron.pretrain_t5":
        assert "did you mean --lr-decay-style?" in typo[0]
    if module != "megatron.pretrain_t5":  # the trainer lists its other problems with them
        assert len(err) <= 3, err  # and a missing required flag, where the tool has one


@pytest.mark.parametrize("module", ["megatron.generate", "data_tools.preprocess_data"])
def test_a_malformed_value_is_one_line_beside_the_unknown_flags(module, capsys):
    flag = "--num-beams" if module == "megatron.generate" else "--workers"
    status, err = refusal(module, ["--bogus", flag, "x"], capsys)
    assert status == 2
    assert len(err) == 2 and "unknown flag --bogus" in err[0], err
    assert f"argument {flag}: invalid int value: 'x'" in err[1], err


def test_only_the_speaking_rank_prints(capsys, agent_store):
    """Rank 1 of a torchrun job prints nothing and leaves once rank 0 has said it printed
    (through the launcher's store, which tests/unit/conftest.py's agent_store stands for);
    the first rank of another node names its node."""
    store, env = agent_store(4)
    silent_left = []

    def silent():
        with pytest.raises(SystemExit) as e:
            refuse(["unknown flag --x"], {**env, "RANK": "1", "LOCAL_RANK": "1",
                                          "GROUP_RANK": "0"})
        silent_left.append(e.value.code)

    waiter = threading.Thread(target=silent)
    waiter.start()
    with pytest.raises(SystemExit) as spoke:
        refuse(["unknown flag --x"], {**env, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    waiter.join(60)
    assert spoke.value.code == 2 and silent_left == [2]
    with pytest.raises(SystemExit):
        refuse(["unknown flag --x"], {**env, "RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1"})
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: unknown flag --x" and len(err) == 2, err
    assert err[1].startswith("error (node 1, ") and err[1].endswith("): unknown flag --x")


def test_a_tool_speaks_for_itself_whatever_its_rank(capsys, monkeypatch):
    """A data tool is no rank of a job: started by srun as task 3 of 4 (its own shard, maybe
    its own problem), it says why, and does not wait for a rank 0 that is not there."""
    for key, value in (("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "3")):
        monkeypatch.setenv(key, value)
    status, err = refusal("data_tools.merge_datasets", ["--bogus"], capsys)
    assert status == 2 and any("unknown flag --bogus" in line for line in err), err
