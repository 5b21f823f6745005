"""Training metrics: peak TFLOP/s lookup, timer, interval rates by hand, log line, writers."""

import math

import pytest

from megatron.training.metrics import (IntervalStats, MetricsWriter, Timer, format_line,
                                       peak_tflops)


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),   # SXM: the CUDA name does not say so
    ("NVIDIA H100 PCIe", "bf16", 756.0),        # longer key beats "H100"
    ("NVIDIA H100 PCIe", "tf32", 378.0),
    ("NVIDIA H200", "bfloat16", 989.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),   # an A100, not an A10
    ("NVIDIA A10", "fp16", 125.0),
    ("NVIDIA L40S", "bf16", 362.0),             # an L40S, not an L4
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA A10G", "bf16", None),              # AWS part, not in the table: not an A10
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100-SXM2-32GB", "bf16", None),     # no bf16 on Volta
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("cpu", "bf16", None),
    ("Intel(R) Xeon(R) Platinum 8480+", "fp32", None),
])
def test_peak_tflops_table(name, dtype, expected):
    assert peak_tflops(name, dtype) == expected


def test_peak_tflops_override_wins_and_is_checked():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", override=500.0) == 500.0
    assert peak_tflops("cpu", "bf16", override=1.5) == 1.5
    with pytest.raises(ValueError, match="peak-tflops"):
        peak_tflops("cpu", "bf16", override=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        peak_tflops("NVIDIA H100", "int8")


def fake_clock(times):
    it = iter(times)
    return lambda: next(it)


def test_timer_tiles_steps_and_sums_data_wait():
    # construct, then step 1: data 1.0->1.5 and 2.0->2.25, end at 4.0; step 2: end at 6.0
    timer = Timer(clock=fake_clock([0.0, 1.0, 1.5, 2.0, 2.25, 4.0, 6.0]))
    timer.data_start(); timer.data_end()
    timer.data_start(); timer.data_end()
    assert timer.step_end() == (4.0, 0.75)
    assert timer.step_end() == (2.0, 0.0)
    with pytest.raises(RuntimeError, match="data_start"):
        timer.data_end()


def test_interval_stats_by_hand():
    stats = IntervalStats()
    # two counted steps and one overflow step, 2 s each, on 4 devices
    stats.add_step(loss_sum=300.0, loss_count=100, grad_norm=1.0, skipped=False,
                   input_tokens=1000, target_tokens=100, model_flops=4e12, step_time_s=2.0,
                   data_wait_s=0.1)
    stats.add_step(loss_sum=float("nan"), loss_count=100, grad_norm=float("inf"), skipped=True,
                   input_tokens=1000, target_tokens=100, model_flops=4e12, step_time_s=2.0,
                   data_wait_s=0.2)
    stats.add_step(loss_sum=100.0, loss_count=100, grad_norm=3.0, skipped=False,
                   input_tokens=1000, target_tokens=100, model_flops=4e12, step_time_s=2.0,
                   data_wait_s=0.3)
    s = stats.summary(iteration=30, consumed_samples=960, lr=1e-4, loss_scale=1024.0,
                      world_size=4, peak_tflops=2.0)
    assert s["iteration"] == 30 and s["consumed_samples"] == 960 and s["lr"] == 1e-4
    assert s["loss"] == pytest.approx(400.0 / 200)          # skipped step left out
    assert s["grad_norm"] == pytest.approx(2.0)
    assert s["loss_scale"] == 1024.0 and s["skipped"] == 1
    assert s["input_tokens_per_s"] == pytest.approx(3000 / 6.0)
    assert s["target_tokens_per_s"] == pytest.approx(300 / 6.0)
    assert s["tflops_per_device"] == pytest.approx(12e12 / 6.0 / 4 / 1e12)  # 0.5
    assert s["mfu"] == pytest.approx(0.5 / 2.0)
    assert s["data_wait_s"] == pytest.approx(0.6 / 3)
    assert s["step_time_s"] == pytest.approx(2.0)
    assert s["memory"] > 0                                  # peak RSS on CPU

    # summary resets: an empty interval has no loss, no rates, no MFU
    empty = stats.summary(iteration=31, consumed_samples=992, lr=1e-4, loss_scale=None,
                          world_size=4, peak_tflops=None)
    assert empty["loss"] is None and empty["skipped"] == 0
    assert empty["tflops_per_device"] is None and empty["mfu"] is None


def make_summary(**over):
    s = {"iteration": 100, "consumed_samples": 3200, "lr": 1e-4, "loss": 5.4321,
         "grad_norm": 1.234, "loss_scale": 1.0, "skipped": 0, "input_tokens_per_s": 12345.0,
         "target_tokens_per_s": 3456.0, "tflops_per_device": 1.23, "mfu": 0.401,
         "memory": int(1.23 * 2**30), "data_wait_s": 0.01, "step_time_s": 0.53}
    s.update(over)
    return s


def test_format_line_fields():
    line = format_line(make_summary(), train_iters=1000)
    assert line == (" iteration      100/    1000 | consumed samples: 3200 | lr: 1.000E-04 | "
                    "loss: 5.4321E+00 | grad norm: 1.234 | loss scale: 1.0 | skipped: 0 | "
                    "tokens/s in: 12345 tgt: 3456 | TFLOP/s/dev: 1.23 | MFU: 40.1% | "
                    "mem: 1.23 GiB | data wait: 0.01 s | step: 0.53 s")


def test_format_line_omits_mfu_when_unknown():
    line = format_line(make_summary(mfu=None, loss_scale=None), train_iters=1000)
    assert "MFU" not in line and "loss scale" not in line
    assert "TFLOP/s/dev: 1.23" in line and "loss: 5.4321E+00" in line


def read_scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_writer_log_file_and_tensorboard(tmp_path, capsys):
    log_file, tb_dir = tmp_path / "logs" / "nested" / "train.log", tmp_path / "tb"
    writer = MetricsWriter(log_file, tb_dir, enabled=True, train_iters=1000)
    writer.write_text("config: t5-small")
    writer.write(make_summary(iteration=10, loss=5.0, mfu=None))
    writer.write(make_summary(iteration=20, loss=4.0))
    # flushed per write: the file is complete before close (what `tail -f` and a crash see)
    assert len(log_file.read_text().splitlines()) == 3
    writer.write_eval(20, "valid", 3.21)
    writer.write_eval(30, "test", 50.0)
    writer.close()

    lines = log_file.read_text().splitlines()
    assert lines[0] == "config: t5-small"
    assert lines[1].startswith(" iteration       10/    1000 |") and "MFU" not in lines[1]
    assert "loss: 4.0000E+00" in lines[2] and "MFU: 40.1%" in lines[2]
    assert lines[3] == (" validation loss at iteration 20 | lm loss: 3.2100E+00 | "
                        "lm loss PPL: 2.4779E+01 |")
    assert lines[4].startswith(" test loss at iteration 30 | lm loss: 5.0000E+01 | "
                               f"lm loss PPL: {math.exp(20):.4E}")  # true loss, capped PPL
    assert capsys.readouterr().out.splitlines() == lines

    assert read_scalars(tb_dir, "train/loss") == [(10, 5.0), (20, 4.0)]
    assert read_scalars(tb_dir, "train/mfu") == [(20, pytest.approx(0.401))]  # None skipped
    assert read_scalars(tb_dir, "train/tokens_per_s") == [(10, 12345.0), (20, 12345.0)]
    assert read_scalars(tb_dir, "train/lr") == [(10, pytest.approx(1e-4)),
                                                (20, pytest.approx(1e-4))]
    assert read_scalars(tb_dir, "valid/loss") == [(20, pytest.approx(3.21))]
    assert read_scalars(tb_dir, "valid/ppl") == [(20, pytest.approx(math.exp(3.21), rel=1e-6))]
    assert read_scalars(tb_dir, "test/ppl") == [(30, pytest.approx(math.exp(20), rel=1e-6))]


def test_disabled_writer_creates_nothing(tmp_path, capsys):
    writer = MetricsWriter(tmp_path / "logs" / "train.log", tmp_path / "tb", enabled=False)
    writer.write_text("hello")
    writer.write(make_summary())
    writer.write_eval(1, "valid", 1.0)
    writer.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def test_write_eval_rejects_unknown_split(tmp_path):
    writer = MetricsWriter(None, None, enabled=True)
    with pytest.raises(ValueError, match="'valid' or 'test'"):
        writer.write_eval(1, "validation", 1.0)
