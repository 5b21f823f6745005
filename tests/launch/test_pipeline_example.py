"""launch/examples/t5_11b_3d_tp4_pp4.sh: its flags pass the entry point's --dry-run on the 64
GPUs it is written for (TP 4 x PP 4 x DP 4) and on 128, with the cut, the bubble and every
stage's memory estimate inside an 80 GB GPU; and it names missing settings like the other
examples."""

from __future__ import annotations

import re

import pytest

from test_scripts import DRY_RUN, REPO, bash

SCRIPT = REPO / "launch/examples/t5_11b_3d_tp4_pp4.sh"


@pytest.mark.parametrize("world_size, dp, micro_batches", [(64, 4, 64), (128, 8, 32)])
def test_3d_example_passes_the_dry_run(world_size, dp, micro_batches, tiny_data, tmp_path):
    proc = bash(SCRIPT, "--dry-run-device", "cuda", env={
        "DATA": tiny_data.prefix, "TOKENIZER": tiny_data.spm, "OUT": str(tmp_path / "out"),
        "LAUNCHER": DRY_RUN, "WORLD_SIZE": str(world_size)})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"valid for {world_size} processes (TP 4 x PP 4 x DP {dp})" in out
    assert "precision bf16; ZeRO 1" in out
    assert f"accumulation {micro_batches} = global 2048" in out
    assert "pipeline: 4 stages" in out
    assert len(re.findall(r"^  stage [0-3]: ", out, re.M)) == 4
    bubble = 100 * 3 / (micro_batches + 3)
    assert f"pipeline bubble: {bubble:.1f}% of a step idle" in out
    assert f"3 / {micro_batches + 3}" in out
    rows = re.findall(r"^ +([0-3]) +[\d,]+ +(\d) +(?:[\d.]+ +){6}([\d.]+) +[\d.]+$", out, re.M)
    assert [int(s) for s, _, _ in rows] == [0, 1, 2, 3], out
    assert [int(k) for _, k, _ in rows] == [4, 3, 2, 1]  # 1F1B: P - s micro-batches in flight
    for stage, _, total_gib in rows:
        assert 1 < float(total_gib) * 2 ** 30 < 80e9, f"stage {stage}: {total_gib} GiB"


def test_3d_example_names_missing_settings(tmp_path):
    proc = bash(SCRIPT)
    assert proc.returncode == 2 and "error: set DATA" in proc.stderr and "OUT" in proc.stderr
    proc = bash(SCRIPT, env={"DATA": str(tmp_path / "nothing"), "TOKENIZER": str(tmp_path / "x"),
                             "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and "not found" in proc.stderr
