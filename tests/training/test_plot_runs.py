"""python -m megatron.plot on real runs: a straight one (global batch 4) and a resumed one (global
batch 8, three starts in one log: the third goes back to the first's checkpoint with another
learning rate and fewer steps, so its steps replace those the second had logged, and the second's
last step, which it does not redo, is gone too; the first start, with --no-plots, draws no
figures at its end). The figures are read back:
their points are the values the log says and the training state returned. Run a also logs
per-layer gradient norms (--log-grad-norms-per-layer): its heat map holds the logged values."""

import re

import numpy as np
import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain

from megatron.plot.__main__ import main
from megatron.plot.figures import build_figures
from megatron.plot.find import load_run

pytestmark = pytest.mark.slow
PNGS = ["grad_norm.png", "loss.png", "lr.png", "memory.png", "tokens_per_s.png"]
TRAIN = re.compile(r"iteration +(\d+)/ *\d+ \| consumed samples: (\d+) \| lr: (\S+) \| "
                   r"loss: (\S+) \|")
LAYERS = re.compile(r" grad norm per layer at iteration (\d+): (.*)")


def logged_starts(text):
    """[[(iteration, samples, lr, loss) of each metrics line] for each start of the log]."""
    starts = text.split("flags: ")[1:]
    return [[(int(m[1]), int(m[2]), float(m[3]), float(m[4])) for m in TRAIN.finditer(s)]
            for s in starts]


def gid_lines(figure):
    return {line.get_gid(): line.get_xydata() for ax in figure.axes for line in ax.get_lines()}


def test_plot_a_straight_and_a_resumed_run(train_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_a = base_argv(train_data, "--save", str(a / "ckpt"), "--log-file", str(a / "train.log"),
                      "--tensorboard-dir", str(a / "tb"), "--log-interval", "1",
                      "--log-grad-norms-per-layer", iters=4)

    def run_b(*extra, iters=6):
        return base_argv(train_data, "--global-batch-size", "8", "--log-file",
                         str(b / "log.txt"), "--log-interval", "1", *extra, iters=iters)

    straight, first, second, third = run_workers(1, run_pretrain, [
        run_a,
        run_b("--save", str(b / "first"), "--exit-interval", "2", "--no-plots"),
        run_b("--load", str(b / "first"), "--save", str(b / "ckpt"), "--exit-interval", "5"),
        run_b("--load", str(b / "first"), "--save", str(b / "ckpt"), "--lr", "1e-3",
              "--override-lr-scheduler", iters=4),
    ], timeout=600)[0]
    assert [first["iteration"], second["iteration"], third["iteration"]] == [2, 5, 4]
    # the third start took other steps than the second from iteration 3 on
    assert third["losses"][4] != second["losses"][4]

    # the trainer drew each run into its --save folder at the end, but for the start with
    # --no-plots
    assert sorted(p.name for p in (a / "ckpt" / "plots").iterdir()) == \
        sorted(PNGS + ["grad_norm_per_layer.png"])
    assert sorted(p.name for p in (b / "ckpt" / "plots").iterdir()) == PNGS
    assert not (b / "first" / "plots").exists()
    text_b = (b / "log.txt").read_text()
    assert f"plots: 5 figures in {b / 'ckpt' / 'plots'}" in text_b
    assert text_b.count("plots: ") == 2  # the second and third starts

    # the command line: a --save folder (its log found through meta.json) and a log file
    out = tmp_path / "cmp"
    assert main([str(a / "ckpt"), str(b / "log.txt"), "--x", "samples", "--output",
                 str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(PNGS + ["grad_norm_per_layer.png"])
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    runs = [load_run(a / "ckpt", "a"), load_run(b / "log.txt", "b")]
    assert runs[0].source == a / "train.log" and runs[1].starts == 3
    figures = build_figures(runs, x="samples")
    loss, lr = gid_lines(figures["loss"]), gid_lines(figures["lr"])

    # what the log says, parsed here: run b is its first start's steps, then its third's
    (logged_a,) = logged_starts((a / "train.log").read_text())
    start1, start2, start3 = logged_starts(text_b)
    assert [p[0] for p in start2] == [3, 4, 5] and [p[0] for p in start3] == [3, 4]
    for name, logged, state, batch in (("a", logged_a, straight["losses"], 4),
                                       ("b", start1 + start3,
                                        first["losses"] | third["losses"], 8)):
        np.testing.assert_array_equal(loss[f"{name}|raw"], [(s, v) for _, s, _, v in logged])
        np.testing.assert_array_equal(lr[f"{name}|raw"], [(s, r) for _, s, r, _ in logged])
        # samples: the runs' different batch sizes line up
        assert [s for _, s, _, _ in logged] == [batch * i for i in sorted(state)]
        np.testing.assert_allclose(loss[f"{name}|raw"][:, 1],
                                   [state[i] for i in sorted(state)], rtol=6e-5)
    # validation points: b's at 2 (first start) and at 4 (third; not the second's), as the
    # states say
    assert [e[:2] for e in second["evals"]] == [(4, "valid")]
    evals_b = [(it, v) for it, split, v, _ in first["evals"] + third["evals"] if split == "valid"]
    assert [it for it, _ in evals_b] == [2, 4]
    np.testing.assert_allclose(loss["b|valid"], [(8 * it, v) for it, v in evals_b], rtol=6e-5)
    (test_b,) = [(it, v) for it, split, v, _ in third["evals"] if split == "test"]
    np.testing.assert_allclose(loss["b|test"], [(8 * test_b[0], test_b[1])], rtol=6e-5)

    # run a's heat map: [layer group, step] of the per-layer lines its log holds
    layers = {int(m[1]): dict(pair.rsplit(" ", 1) for pair in m[2].split(", "))
              for m in LAYERS.finditer((a / "train.log").read_text())}
    assert sorted(layers) == [1, 2, 3, 4]
    groups = list(layers[1])
    assert groups[0] == "embedding" and groups[-1] == "lm_head"
    mesh = next(c for ax in figures["grad_norm_per_layer"].axes for c in ax.collections
                if c.get_gid() == "a|layers")
    np.testing.assert_allclose(np.asarray(mesh.get_array()),
                               [[float(layers[it][g]) for it in (1, 2, 3, 4)] for g in groups],
                               rtol=1e-12)

    # run a's TensorBoard events give the same curves, unrounded (float32)
    tb = build_figures([load_run(a / "tb", "a")], x="step", smoothing=0)
    got = gid_lines(tb["loss"])["a|raw"]
    np.testing.assert_array_equal(got[:, 0], sorted(straight["losses"]))
    np.testing.assert_allclose(got[:, 1], [straight["losses"][i]
                                           for i in sorted(straight["losses"])], rtol=1e-6)
    norms = gid_lines(tb["grad_norm"])["a|raw"][:, 1]
    np.testing.assert_allclose(norms, [straight["grad_norms"][i]
                                       for i in sorted(straight["grad_norms"])], rtol=1e-6)
