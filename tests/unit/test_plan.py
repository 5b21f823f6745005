"""`python -m megatron.plan`: its memory is `--dry-run`'s for the same flags, T5-11B fits on
8 nodes of 8 H100s, a 100B model gets a pipeline, an impossible request says what is missing,
and the time model's terms are the hand-computed formulas."""

import json
import re

import pytest

from megatron.arguments import parse_args
from megatron.model.meta import num_parameters
from megatron.plan.__main__ import main as plan_main
from megatron.plan.cluster import Cluster, device_named
from megatron.plan.planner import as_json, machine_for, plan
from megatron.plan.search import GIB, Request
from megatron.plan.timing import FLATTEN_PASSES, LayoutShape, Machine, step_time
from megatron.pretrain_t5 import main as train_main
from megatron.cost.memory import estimate_run


def h100_cluster(nodes=8):
    device = device_named("H100-80GB")
    return Cluster(nodes, 8, device, inter_node_gbs=device.inter_node_gbs,
                   host_memory_gib=device.host_memory_gib)


@pytest.fixture(scope="module")
def t5_11b_plan():
    request = Request("t5-11b", 512, 114, 2048)
    cluster = h100_cluster()
    return plan(request, cluster, machine_for(cluster, "bf16", 0.6))


def dry_run_total(capsys, argv):
    """The device total `--dry-run --dry-run-device cuda` prints (the largest stage's with a
    pipeline), GiB."""
    assert train_main(argv + ["--dry-run", "--dry-run-device", "cuda"]) == 0
    out = capsys.readouterr().out
    match = re.search(r"largest: stage \d+, ([\d.]+) GiB", out) or \
        re.search(r"total on device\s+([\d.]+) GiB", out)
    assert match, out
    return float(match.group(1))


def test_memory_per_layout_equals_dry_run(t5_11b_plan, train_data, capsys, monkeypatch):
    """The best layouts, the best pipeline and the best offloading one: the planner's memory
    per device is what --dry-run prints for its flags (and, in bytes, what the validated run's
    estimate gives)."""
    result = t5_11b_plan
    chosen = result.ranked[:3]
    chosen.append(next(c for c in result.ranked if c.pp > 1))
    chosen.append(next(c for c in result.candidates
                       if c.stages and c.offload_optimizer != "none"))
    chosen.append(next(c for c in result.candidates if c.stages and not c.fits))
    monkeypatch.setenv("WORLD_SIZE", "64")
    for c in chosen:
        argv = c.flags + ["--data-path", train_data.prefix, "--tokenizer-model",
                          train_data.spm, "--train-iters", "10", "--lr", "1e-4"]
        config = parse_args(argv + ["--dry-run", "--dry-run-device", "cuda"],
                            env={"WORLD_SIZE": "64"})
        layout = config.layout()
        assert estimate_run(layout, "cuda").total == c.memory.total, c.label()
        assert dry_run_total(capsys, argv) == pytest.approx(c.memory.total / GIB, abs=6e-4)


def test_t5_11b_fits_on_8x8_h100(t5_11b_plan):
    result = t5_11b_plan
    assert result.ranked, "no layout of T5-11B fits on 64 H100s"
    usable = 0.9 * 79.6 * GIB
    for c in result.ranked:
        assert c.world_size == 64 and c.memory.total <= usable
    times = [c.time.total for c in result.ranked]
    assert times == sorted(times)
    layouts = as_json(result, 5)
    assert len(layouts) == 5
    for entry in layouts:
        assert entry["world_size"] == 64 and entry["memory_per_device_gib"] <= 0.9 * 79.6
        assert isinstance(entry["flags"], list) and "--model-config" in entry["flags"]
        assert entry["step_time_s"] == pytest.approx(sum(entry["step_time"].values()))
        assert 0 < entry["mfu"] < 1


def test_a_100b_model_gets_a_pipeline(tmp_path):
    """About 100 B parameters (28 + 28 blocks of d_model 10240, d_ff 40960 gated, 80 heads of
    128) on 16 nodes of 8 H100s: the whole model's states (1.6 TB) need every device, and the
    fastest layouts cut it into stages."""
    config = dict(vocab_size=32128, d_model=10240, d_kv=128, d_ff=40960, num_layers=28,
                  num_decoder_layers=28, num_heads=80, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False, dropout_rate=0.0)
    path = tmp_path / "t5-100b.json"
    path.write_text(json.dumps(config))
    from megatron.model.config import T5Config

    assert 95e9 < num_parameters(T5Config.from_json(path)) < 110e9
    request = Request(str(path), 512, 114, 1024)
    cluster = h100_cluster(16)
    result = plan(request, cluster, machine_for(cluster, "bf16", 0.6))
    assert result.ranked
    assert result.ranked[0].pp > 1, result.ranked[0].label()


def test_an_impossible_request_says_what_is_missing(capsys):
    """T5-11B on one 40 GB A100 with 64 GiB of host memory: nothing fits; the report names the
    memory per device it lacks and the nodes on which it would fit."""
    code = plan_main(["--model-config", "t5-11b", "--global-batch-size", "64",
                      "--cluster", "1x1xA100-40GB", "--cpu-memory-gib", "64",
                      "--max-micro-batch", "8"])
    out = capsys.readouterr().out
    assert code == 1
    assert "nothing fits" in out
    assert re.search(r"needs [\d.]+ GiB per device, [\d.]+ GiB more than", out) or \
        re.search(r"GiB more host memory per node", out), out
    assert re.search(r"fits on \d+ nodes of 1", out), out


def test_json_and_explain(capsys):
    argv = ["--model-config", "t5-base", "--global-batch-size", "128", "--cluster",
            "1x8xA100-80GB", "--max-micro-batch", "32"]
    assert plan_main(argv + ["--json", "--top", "3"]) == 0
    layouts = json.loads(capsys.readouterr().out)
    assert len(layouts) == 3 and [e["rank"] for e in layouts] == [1, 2, 3]
    for entry in layouts:
        assert entry["world_size"] == 8
        assert {"flags", "memory_per_device_gib", "step_time", "tokens_per_s", "mfu",
                "command"} <= set(entry)
        assert entry["command"].startswith("NPROC_PER_NODE=8 launch/torchrun.sh ")
    assert plan_main(argv + ["--explain", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "#1 " in out and "#2 " in out and "#3 " not in out
    assert re.search(r"slower by \d+% \(\+[\d.e-]+ s [a-zA-Z/ ]+\): TP", out), out
    assert "refused by the trainer (" in out  # e.g. bf16 without ZeRO, TP not dividing heads


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "8x8"], "--cluster 8x8: expected NODESxGPUSxDEVICE"),
    (["--cluster", "8x8xB300"], "--gpu: unknown device 'B300'"),
    (["--cluster", "8x8xH100-80GB", "--nodes", "2"], "--cluster replaces --nodes"),
    (["--nodes", "2", "--gpus-per-node", "8"], "--gpu is missing: give one of H100-80GB, "
     "H200-141GB, H800-80GB, A100-80GB, A100-40GB, A800-80GB, V100-32GB, L40S-48GB"),
    (["--nodes", "2", "--gpus-per-node", "8", "--gpu-tflops", "100"],
     "describe a device not in the table with both --gpu-memory-gib and --gpu-tflops"),
    (["--cluster", "1x8xV100-32GB", "--precision", "bf16"],
     "--precision bf16: V100-32GB has no bf16 support (it computes fp16, fp32)"),
    (["--cluster", "1x8xH100-80GB", "--efficiency", "1.5"], "--efficiency must be in (0, 1]"),
])
def test_bad_command_lines(capsys, argv, message):
    code = plan_main(["--model-config", "t5-small", "--global-batch-size", "64"] + argv)
    assert code == 2
    assert message in capsys.readouterr().err


SMALL = ["--model-config", "t5-small", "--global-batch-size", "16", "--max-micro-batch", "2",
         "--top", "1"]


def test_v100_is_planned_in_fp16_and_says_why(capsys):
    """A V100 computes no bf16: without --precision the plan is fp16 and says so, the header's
    peak is the fp16 one the time model uses (125, not the fp32 15.7 labelled bf16), and no
    proposed command line carries --bf16."""
    assert plan_main(SMALL + ["--cluster", "1x8xV100-32GB"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[:4]
    assert header[0].endswith(", fp16"), header
    assert "(32 GiB, 125 TFLOP/s fp16 peak)" in header[1], header
    assert header[2].startswith("precision fp16: V100-32GB has no bf16 support"), header
    assert "--fp16" in out and "--bf16" not in out
    assert plan_main(SMALL + ["--cluster", "1x8xV100-32GB", "--json"]) == 0
    captured = capsys.readouterr()
    flags = [f for entry in json.loads(captured.out) for f in entry["flags"]]
    assert "--fp16" in flags and "--bf16" not in flags
    assert "no bf16 support" in captured.err


def test_header_peak_is_the_plans_precision(capsys):
    """The header's peak is the table's figure at the plan's precision (A100: 312 bf16, 156
    fp32)."""
    for precision, peak in (("bf16", "312"), ("fp32", "156")):
        assert plan_main(SMALL + ["--cluster", "1x8xA100-80GB", "--precision", precision]) == 0
        header = capsys.readouterr().out.splitlines()
        assert f"(80 GiB, {peak} TFLOP/s {precision} peak)" in header[1], header
        assert header[2].startswith("candidates:"), header  # asked for: no note


def test_a_device_not_in_the_table_by_name(capsys):
    assert plan_main(SMALL + ["--nodes", "1", "--gpus-per-node", "8", "--gpu", "B300",
                              "--gpu-memory-gib", "180", "--gpu-tflops", "2250"]) == 0
    header = capsys.readouterr().out.splitlines()
    assert "8 B300 (180 GiB, 2250 TFLOP/s bf16 peak)" in header[1], header


def test_a_corrected_v100_still_has_no_bf16():
    """--gpu-tflops corrects the peak of the precisions the device computes, and adds none."""
    from megatron.plan.cluster import custom_device, plan_precision

    v100 = custom_device(device_named("V100-32GB"), None, 130.0)
    assert v100.peak_tflops == {"fp16": 130.0, "fp32": 130.0}
    assert plan_precision(v100, None)[0] == "fp16"
    with pytest.raises(ValueError, match="V100-32GB has no bf16 support"):
        plan_precision(v100, "bf16")
    assert plan_precision(device_named("A100-80GB"), None) == ("bf16", None)


def test_help_shows_every_default(capsys):
    """Each flag with a default says it in --help; the flags whose default depends on the
    device (or the encoder length) say what it is."""
    from megatron.plan.__main__ import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    with_default = [a for a in parser._actions
                    if a.option_strings and a.default not in (None, False, "==SUPPRESS==")]
    assert {a.dest for a in with_default} >= {"encoder_seq_length", "efficiency", "headroom",
                                             "top", "max_micro_batch", "nvme_gbs"}
    for action in with_default:
        assert f"(default: {action.default})" in text, action.option_strings
    for flag_default in ("default: bf16 where the device computes it, else fp16",
                         "default: the target length span corruption gives",
                         "default: the device table's"):
        assert flag_default in text


def test_bad_model_config(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert plan_main(["--model-config", str(bad), "--global-batch-size", "8",
                      "--cluster", "1x8xH100-80GB"]) == 2
    assert str(bad) in capsys.readouterr().err


# The time model, term by term, against the formulas computed by hand -------------------------
MACHINE = Machine(devices_per_node=4, flops=1e12, half_rows=0.0, memory_bw=1e11,
                  intra_bw=1e10, inter_bw=8e9, host_link_bw=2e9, host_memory_bw=4e10,
                  latency=1e-5)


def shape(**kw):
    base = dict(tp=1, pp=1, dp=1, micro_batch=2, micro_batches=3, encoder_len=16,
                decoder_len=8, d_model=64, precision="fp32", zero_stage=0,
                offload_optimizer="none", offload_param="none", recompute=False,
                block_flops=(1e9, 2e9, 5e8), stage_blocks=[(2, 2)], stage_parameters=[1000],
                saved_per_micro_batch=[1e6])
    base.update(kw)
    return LayoutShape(**base)


def test_compute_and_optimizer_by_hand():
    t = step_time(shape(), MACHINE)
    per_micro_batch = 3 * 2 * (2 * 1e9 + 2 * 2e9 + 5e8) / 1e12 + 3 * 1e6 / 1e11
    assert t.compute == pytest.approx(3 * per_micro_batch, rel=1e-12)
    assert t.optimizer == pytest.approx(1000 * 36 / 1e11, rel=1e-12)
    assert t.tp_comm == t.pp_bubble == t.dp_comm == t.offload == 0
    recomputed = step_time(shape(recompute=True), MACHINE)
    extra = 3 * 2 * (2 * 1e9 + 2 * 2e9) / 1e12
    assert recomputed.compute - t.compute == pytest.approx(extra, rel=1e-12)
    half = step_time(shape(), Machine(**{**MACHINE.__dict__, "half_rows": 16.0}))
    enc_rate, dec_rate = 1e12 * 32 / 48, 1e12 * 16 / 32  # rows: 2 x 16 and 2 x 8
    per_micro_batch = 3 * 2 * (2 * 1e9 / enc_rate + (2 * 2e9 + 5e8) / dec_rate) + 3e-5
    assert half.compute == pytest.approx(3 * per_micro_batch, rel=1e-12)


def test_data_parallel_terms_by_hand():
    """ZeRO 0: one all-reduce of the gradients per step; ZeRO 2: one per micro-batch plus the
    parameters' all-gather; ZeRO 3: gather and reduce-scatter per micro-batch. DP 2 within a
    node of 4 (NVLink); DP 8 over 2 nodes (the network shared by 4 devices)."""
    psi, m = 1000, 3
    for dp, bw in ((2, 1e10), (8, 8e9 / 4)):
        copies = lambda nbytes: FLATTEN_PASSES * nbytes / 1e11  # noqa: E731
        ring = lambda share, nbytes: share * nbytes / bw + 1e-5 + copies(nbytes)  # noqa: E731
        ar, ag = 2 * (dp - 1) / dp, (dp - 1) / dp
        t0 = step_time(shape(dp=dp), MACHINE)
        assert t0.dp_comm == pytest.approx(ring(ar, 4 * psi), rel=1e-12)
        t2 = step_time(shape(dp=dp, zero_stage=2), MACHINE)
        assert t2.dp_comm == pytest.approx(m * ring(ar, 4 * psi) + ring(ag, 4 * psi), rel=1e-12)
        assert t2.optimizer == pytest.approx(-(-psi // dp) * 36 / 1e11, rel=1e-12)
        t3 = step_time(shape(dp=dp, zero_stage=3, persistent_parameters=100), MACHINE)
        gather = ag * 4 * 900 / bw + 1e-5
        assert t3.dp_comm == pytest.approx(m * (gather + ring(ag, 4 * psi)), rel=1e-12)
        regather = step_time(shape(dp=dp, zero_stage=3, persistent_parameters=100,
                                   max_live_parameters=500), MACHINE)
        assert regather.dp_comm - t3.dp_comm == pytest.approx(m * gather, rel=1e-12)


def test_tensor_and_pipeline_terms_by_hand():
    """TP 2: all-reduces of b x len x d x 4 bytes; PP 2 with m micro-batches: (m + P - 1)
    slots of the slower stage, each with two transfers, less the work."""
    s = shape(tp=2, stage_blocks=[(1, 0)], block_flops=(1e9, 2e9, 0.0))
    t = step_time(s, MACHINE)
    enc = 2 * 16 * 64 * 4
    per_ar = 1 * enc / 1e10 + 1e-5  # 2 (n - 1) / n = 1 for two ranks
    # forward: 2 per encoder block + the embedding and the head's input; backward: 2 + head
    dec = 2 * 8 * 64 * 4
    expected = 3 * (3 * per_ar + (dec / 1e10 + 1e-5) + 2 * per_ar + (dec / 1e10 + 1e-5))
    assert t.tp_comm == pytest.approx(expected, rel=1e-12)
    p = shape(pp=2, dp=2, stage_blocks=[(2, 0), (0, 2)], stage_parameters=[600, 700],
              saved_per_micro_batch=[0.0, 0.0], block_flops=(1e9, 2e9, 0.0))
    t = step_time(p, MACHINE)
    work = [3 * 2 * 2 * 1e9 / 1e12, 3 * 2 * 2 * 2e9 / 1e12]
    wire = (enc + dec) / 1e10 + 1e-5  # stage stride 2 within a node of 4
    slot = max(work) + 2 * wire
    assert t.compute == pytest.approx(3 * sum(work) / 2, rel=1e-12)
    assert t.pp_bubble == pytest.approx((3 + 1) * slot - 3 * sum(work) / 2, rel=1e-12)
    assert t.optimizer == pytest.approx(700 * 36 / 1e11, rel=1e-12)  # the fuller stage
