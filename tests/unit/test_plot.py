"""python -m megatron.plot without training: the log reader on a hand-written log of three
starts (one that resumed before steps an earlier start had logged, one that failed before its
first step) with the per-layer gradient norm lines of the shared format; the TensorBoard reader
on events written by the trainer's own MetricsWriter; the figures read back (raw, smoothed,
evaluation points, the heat map); where a RUN finds its log; the errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.plot.__main__ import main
from megatron.plot.at_end import plot_at_end
from megatron.plot.figures import build_figures, smooth
from megatron.plot.find import RunNotFound, default_labels, load_run, resolve
from megatron.plot.logfile import parse_lines
from megatron.plot.runs import Run
from megatron.training.metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[2]
GROUPS = ["embedding", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
          "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm", "lm_head"]


def train_line(it, samples, lr, loss, norm, step_s, prefix=" "):
    return (f"{prefix}iteration {it:8d}/{8:8d} | consumed samples: {samples} | lr: {lr:.3E} | "
            f"loss: {loss:.4E} | grad norm: {norm:.3f} | loss scale: 1.0 | skipped: 0 | "
            f"tokens/s in: {1000 + it} tgt: {200 + it} | TFLOP/s/dev: 0.10 | MFU: 12.5% | "
            f"mem: 1.50 GiB | data wait: 0.01 s | step: {step_s:.2f} s")


def layer_line(it, norms):
    return (f" grad norm per layer at iteration {it}: "
            + ", ".join(f"{g} {v:.3E}" for g, v in zip(GROUPS, norms)))


NORMS = {2: [0.1 * (k + 1) for k in range(8)], 4: [0.01 * (k + 1) for k in range(8)],
         6: [2.0 ** -k for k in range(8)]}
FLAGS = "flags: " + json.dumps({"encoder_seq_length": 64, "global_batch_size": 4})
LOG = [
    FLAGS,
    "deepspeed config: {}",
    train_line(2, 8, 1e-3, 9.0, 2.0, 0.5),
    layer_line(2, NORMS[2]),
    " validation loss at iteration 2 | lm loss: 8.9000E+00 | lm loss PPL: 7.3130E+03 |",
    train_line(4, 16, 2e-3, 8.0, 1.5, 0.4),
    layer_line(4, NORMS[4]),
    " validation loss at iteration 4 | lm loss: 7.9000E+00 | lm loss PPL: 2.6973E+03 |",
    "saved checkpoint /ckpt/iter_0000004 (3.7 MiB)",
    # logged by the first start, then redone by the third: replaced
    train_line(6, 24, 3e-3, 7.5, 1.0, 0.3),
    layer_line(6, [9.0] * 8),
    " validation loss at iteration 6 | lm loss: 7.4000E+00 | lm loss PPL: 1.6360E+03 |",
    # a start that failed before its first step: changes nothing
    FLAGS,
    "resumed from /ckpt at iteration 4 (16 samples consumed)",
    "error (rank 0): the data loader died",
    FLAGS,
    "resumed from /ckpt at iteration 4 (16 samples consumed)",
    train_line(5, 20, 2.5e-3, 7.8, 1.2, 0.2, prefix="0: "),  # a launcher's prefix
    train_line(6, 24, 2.0e-3, 7.6, 1.1, 0.2),
    layer_line(6, NORMS[6]),
    train_line(8, 32, 1.0e-3, 7.0, 0.9, 0.25),
    " validation loss at iteration 8 | lm loss: 7.1000E+00 | lm loss PPL: 1.2124E+03 |",
    " test loss at iteration 8 | lm loss: 7.2000E+00 | lm loss PPL: 1.3394E+03 |",
]


def hand_log_run(label="run"):
    return parse_lines(LOG, Run(label=label, source=Path("log.txt")))


def lines(figure):
    return {line.get_gid(): line.get_xydata() for ax in figure.axes for line in ax.get_lines()}


def test_log_reader_merges_the_starts():
    run = hand_log_run()
    assert run.starts == 2 and run.encoder_seq_length == 64
    assert run.train["loss"] == {2: 9.0, 4: 8.0, 5: 7.8, 6: 7.6, 8: 7.0}
    assert run.train["lr"] == {2: 1e-3, 4: 2e-3, 5: 2.5e-3, 6: 2e-3, 8: 1e-3}
    assert run.train["consumed_samples"] == {2: 8, 4: 16, 5: 20, 6: 24, 8: 32}
    assert run.train["tokens_per_s"][5] == 1005 and run.train["target_tokens_per_s"][8] == 208
    assert run.train["mfu"][2] == pytest.approx(0.125) and run.train["memory_gib"][4] == 1.5
    assert run.steps == {2: 2, 4: 2, 5: 1, 6: 1, 8: 2}  # the resumed start's first line: 1 step
    assert run.evals == {"valid": {2: 8.9, 4: 7.9, 8: 7.1}, "test": {8: 7.2}}
    assert sorted(run.layers) == [2, 4, 6]
    for it, norms in NORMS.items():
        assert list(run.layers[it]) == GROUPS
        assert list(run.layers[it].values()) == pytest.approx(norms, rel=1e-3)


def test_log_without_flags_lines_takes_steps_that_go_back_as_a_new_start():
    text = [train_line(i, 4 * i, 1e-3, 9.0 - i, 1.0, 0.1) for i in (1, 2, 3)] + \
           [train_line(i, 4 * i, 1e-3, 5.0 - i, 1.0, 0.1) for i in (2, 3)]
    run = parse_lines(text, Run("r", Path("x")))
    assert run.train["loss"] == {1: 8.0, 2: 3.0, 3: 2.0} and run.starts == 2


def test_x_axes():
    run = hand_log_run()
    its = [2, 4, 5, 6, 8]
    assert run.x_values(its, "samples") == [8, 16, 20, 24, 32]
    assert run.x_values(its, "tokens") == [64 * s for s in (8, 16, 20, 24, 32)]
    seconds = np.cumsum([2 * 0.5, 2 * 0.4, 1 * 0.2, 1 * 0.2, 2 * 0.25])
    assert run.x_values(its, "time") == pytest.approx(seconds / 3600)
    # between and after the logged lines: linear (a batch of 4 samples per step)
    assert run.x_values([3, 7, 9], "samples") == [12, 28, 36]
    run.encoder_seq_length = None  # as from TensorBoard events alone
    with pytest.raises(ValueError, match="sequence length is not known"):
        run.x_values([1], "tokens")


def test_the_time_axis_names_its_clock():
    """--x time sums the logged step times, which leave out evaluation and checkpoint saves (the
    trainer restarts its step clock after them): every figure's axis and the help say so."""
    from megatron.plot.__main__ import build_parser

    figures = build_figures([hand_log_run()], x="time")
    labels = {ax.get_xlabel() for figure in figures.values() for ax in figure.axes} - {""}
    assert labels == {"hours in training steps (logged step times summed; evaluation, "
                      "checkpoint saves, start-up and restarts left out)"}
    text = " ".join(build_parser().format_help().split())
    assert "evaluation, checkpoint saves, start-up and the gaps between restarts are left " \
           "out, so it is not the job's elapsed time" in text


def test_smoothing_is_tensorboards_debiased_moving_average():
    # by hand: last = 0.5 last + 0.5 v; shown last / (1 - 0.5^n)
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert smooth([1.0, float("nan"), 3.0], 0.0)[2] == 3.0


def test_figures_plot_the_logged_values():
    run = hand_log_run()
    figures = build_figures([run], x="samples", smoothing=0.6)
    assert set(figures) == {"loss", "lr", "grad_norm", "tokens_per_s", "memory",
                            "grad_norm_per_layer"}
    loss = lines(figures["loss"])
    samples = [8, 16, 20, 24, 32]
    np.testing.assert_array_equal(loss["run|raw"], list(zip(samples, [9.0, 8.0, 7.8, 7.6, 7.0])))
    np.testing.assert_allclose(loss["run|smoothed"][:, 1],
                               smooth([9.0, 8.0, 7.8, 7.6, 7.0], 0.6))
    np.testing.assert_array_equal(loss["run|valid"], [(8, 8.9), (16, 7.9), (32, 7.1)])
    np.testing.assert_array_equal(loss["run|test"], [(32, 7.2)])
    lr = lines(figures["lr"])
    assert set(lr) == {"run|raw"}  # not smoothed
    np.testing.assert_array_equal(lr["run|raw"][:, 1], [1e-3, 2e-3, 2.5e-3, 2e-3, 1e-3])
    legend = [t.get_text() for t in figures["loss"].axes[0].get_legend().get_texts()]
    assert legend == ["run", "run (validation)", "run (test)"]


def test_per_layer_heat_map_is_layer_by_step():
    figure = build_figures([hand_log_run()])["grad_norm_per_layer"]
    ax = figure.axes[0]
    mesh = next(c for c in ax.collections if c.get_gid() == "run|layers")
    want = np.array([NORMS[it] for it in (2, 4, 6)]).T  # [layer group, step]
    np.testing.assert_allclose(np.asarray(mesh.get_array()), want, rtol=1e-3)
    assert [t.get_text() for t in ax.get_yticklabels()] == GROUPS
    coords = mesh.get_coordinates()  # [groups + 1, steps + 1, (x, y)]
    np.testing.assert_array_equal(coords[0, :, 0], [1, 3, 5, 7])  # cells centred on 2, 4, 6


def write_start(writer, points, resumed_at=None):
    writer.write_text(FLAGS)
    if resumed_at is not None:
        writer.write_text(f"resumed from /ckpt at iteration {resumed_at} (0 samples consumed)")
    for it, loss in points:
        writer.write({"iteration": it, "consumed_samples": 4 * it, "lr": 1e-3 / it,
                      "loss": loss, "grad_norm": 1.0 / it, "loss_scale": 1.0, "skipped": 0,
                      "input_tokens_per_s": 1000.0 + it, "target_tokens_per_s": 100.0,
                      "tflops_per_device": 0.5, "mfu": None, "memory": 2**30 * it,
                      "data_wait_s": 0.0, "step_time_s": 0.1 * it})
        if it % 2 == 0:
            writer.write_eval(it, "valid", loss + 0.5)


def test_log_and_tensorboard_give_the_same_run(tmp_path):
    """The trainer's own writer: start 1 logs 1-4, start 2 resumes at 2 and logs 3-5."""
    log, tb = tmp_path / "log.txt", tmp_path / "tb"
    first = [(1, 9.123456), (2, 8.5), (3, 8.25), (4, 8.0)]
    second = [(3, 7.0), (4, 6.5), (5, 6.0)]
    for points, resumed in ((first, None), (second, 2)):
        writer = MetricsWriter(log, tb, enabled=True, train_iters=5)
        write_start(writer, points, resumed)
        writer.close()
    want = dict(first[:2] + second)
    from_log = load_run(log)
    from_tb = load_run(tb)
    assert from_log.source == log and from_tb.source == tb
    assert from_log.starts == from_tb.starts == 2
    assert from_log.train["loss"] == {i: float(f"{v:.4E}") for i, v in want.items()}
    assert from_tb.train["loss"] == pytest.approx(want, rel=1e-7)  # float32
    assert from_tb.train["memory_gib"] == pytest.approx({i: float(i) for i in want})
    assert from_log.evals == {"valid": {2: 9.0, 4: 7.0}}
    assert from_tb.evals == {"valid": pytest.approx({2: 9.0, 4: 7.0})}
    assert from_log.steps == from_tb.steps == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}


LAYOUT = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
          "data_parallel_size": 1, "zero_stage": 0}
"""The layout every meta.json of the trainer records (its reader refuses one without)."""


def test_a_save_folder_finds_its_log_through_meta_json(tmp_path):
    save, logs = tmp_path / "ckpt", tmp_path / "logs"
    (save / "iter_0000004").mkdir(parents=True)
    logs.mkdir()
    (logs / "train.out").write_text("\n".join(LOG) + "\n")
    flags = {"save": str(save), "log_file": str(logs / "train.out"), "tensorboard_dir": None}
    (save / "iter_0000004" / "meta.json").write_text(json.dumps({"flags": flags,
                                                                 "layout": LAYOUT}))
    assert resolve(save) == ("log", logs / "train.out")
    # moved: a log that was inside the save folder is found inside the folder's new place
    flags["log_file"] = str(tmp_path / "gone" / "sub" / "log.txt")
    flags["save"] = str(tmp_path / "gone")
    (save / "iter_0000004" / "meta.json").write_text(json.dumps({"flags": flags,
                                                                 "layout": LAYOUT}))
    (save / "sub").mkdir()
    (save / "sub" / "log.txt").write_text("\n".join(LOG) + "\n")
    assert resolve(save) == ("log", save / "sub" / "log.txt")
    assert load_run(save).label == tmp_path.name  # ckpt says nothing: its parent's name


def test_default_labels_are_short_and_distinct():
    assert default_labels(["/x/exp1/ckpt", "/x/exp2/log.txt", "/x/exp3/tb/",
                           "/x/exp4/tb/events.out.tfevents.1.host.2.0"]) == \
        ["exp1", "exp2", "exp3", "exp4"]
    assert default_labels(["/x/a/run1/ckpt", "/x/b/run1/ckpt"]) == ["a/run1", "b/run1"]
    assert default_labels(["/x/run1/train.out"]) == ["train.out"]
    assert default_labels(["/x/run1/ckpt", "/x/run1/tb"]) == ["ckpt", "tb"]


def test_cli_writes_pngs_and_names_a_run_without_logs(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "log.txt").write_text("\n".join(LOG) + "\n")
    assert main([str(tmp_path / "a"), "--x", "tokens"]) == 0
    pngs = sorted(p.name for p in (tmp_path / "a" / "plots").iterdir())
    assert pngs == ["grad_norm.png", "grad_norm_per_layer.png", "loss.png", "lr.png",
                    "memory.png", "tokens_per_s.png"]
    for name in pngs:
        assert (tmp_path / "a" / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "a"), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'empty'}: neither a log file nor TensorBoard events found" in err
    assert main([str(tmp_path / "a"), "--smoothing", "1"]) == 2
    assert "--smoothing 1.0: must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(RunNotFound, match="no metrics logged"):
        (tmp_path / "b.log").write_text("nothing here\n")
        load_run(tmp_path / "b.log")


def test_without_matplotlib_the_command_names_the_extra_and_training_logs_one_line(
        tmp_path, monkeypatch):
    (tmp_path / "log.txt").write_text("\n".join(LOG) + "\n")
    blocked = ("import sys; sys.modules['matplotlib'] = None; "
               "from megatron.plot.__main__ import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", blocked, str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, env={"PYTHONPATH": str(REPO),
                                                    "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, done.stderr
    assert "pip install 't5-pretrain[plot]'" in done.stderr
    said = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert plot_at_end(tmp_path, str(tmp_path / "log.txt"), None, said.append) is None
    assert len(said) == 1 and "t5-pretrain[plot]" in said[0]
    assert not (tmp_path / "plots").exists()


def test_plot_at_end_never_raises(tmp_path):
    said = []
    (tmp_path / "log.txt").write_text("no metrics\n")
    assert plot_at_end(tmp_path, str(tmp_path / "log.txt"), None, said.append) is None
    assert said[0].startswith("warning: plots: none written") and "no metrics" in said[0]
    assert plot_at_end(tmp_path, None, None, said.append) is None
    assert "neither --log-file nor --tensorboard-dir" in said[1]
    (tmp_path / "log.txt").write_text("\n".join(LOG) + "\n")
    paths = plot_at_end(tmp_path, str(tmp_path / "log.txt"), None, said.append)
    assert [p.name for p in paths][:2] == ["loss.png", "lr.png"] and math.isfinite(len(said))
    assert said[2].startswith(f"plots: 6 figures in {tmp_path / 'plots'}")


def test_a_long_heat_map_shows_evenly_spaced_logged_columns():
    run = parse_lines([FLAGS] + [layer_line(i, [float(i)] * 8) for i in range(1, 2501)],
                      Run("long", Path("log.txt")))
    mesh = build_figures([run])["grad_norm_per_layer"].axes[0].collections[0]
    columns = np.asarray(mesh.get_array())[0]
    assert len(columns) == 2000 and columns[0] == 1.0 and columns[-1] == 2500.0
    assert set(columns) <= set(map(float, range(1, 2501)))  # logged values, not averages
