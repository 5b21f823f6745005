"""Worker bodies for the training tests: run the real entry point's `pretrain` on each rank."""

from __future__ import annotations

import contextlib
import os

from megatron import parallel_state


def run_pretrain(rank, world_size, argvs):
    """Run each command line in turn; return [{'losses': {iteration: loss}, 'evals': [...]}]."""
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed
    from megatron.pretrain_t5 import pretrain

    out = []
    for argv in argvs:
        config = parse_args(argv, env=os.environ)
        initialize_distributed(config.runtime, config.parallel)
        try:
            state = pretrain(config)
        finally:
            parallel_state.destroy_model_parallel()
        out.append({"losses": dict(state.losses), "grad_norms": dict(state.grad_norms),
                    "evals": list(state.evaluations),
                    "iteration": state.iteration,
                    "layer_grad_norms": dict(state.layer_grad_norms),
                    "moe": dict(state.moe),
                    "denoiser_losses": dict(state.denoiser_losses)})
    return out


def run_timed_then_not(rank, world_size, argvs):
    """Two runs in this process: the first handed a timing listener (megatron/training/timing.py),
    the second none. Returns what the listener was told after each: {'attached': steps it was
    attached to, 'closed': {range name: count}}."""
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed
    from megatron.pretrain_t5 import pretrain
    from megatron.training.timing import RangeListener

    class Counting(RangeListener):
        def __init__(self):
            self.attached, self.counts = 0, {}

        def attach(self, step):
            self.attached += 1

        def closed(self, name, seconds, nbytes):
            self.counts[name] = self.counts.get(name, 0) + 1

    listener, out = Counting(), []
    for argv, listeners in zip(argvs, ([listener], [])):
        config = parse_args(argv, env=os.environ)
        initialize_distributed(config.runtime, config.parallel)
        try:
            pretrain(config, listeners=listeners)
        finally:
            parallel_state.destroy_model_parallel()
        out.append({"attached": listener.attached, "closed": dict(listener.counts)})
    return out


def run_keeping_model(rank, world_size, argvs):
    """As run_pretrain; each result also holds the model's state after the run ('state', CPU
    tensors) and its trainable parameters' names ('trainable')."""
    with built_steps() as built:
        out = []
        for argv in argvs:
            result = run_pretrain(rank, world_size, [argv])[0]
            module = built[-1].engine.module
            result["state"] = {k: v.detach().cpu().clone()
                               for k, v in module.state_dict().items()}
            result["trainable"] = sorted(n for n, p in module.named_parameters()
                                         if p.requires_grad)
            out.append(result)
        return out


def run_pretrain_counting_samples(rank, world_size, argvs):
    """As run_pretrain (with --num-workers 0), each result with 'samples_read': how many
    samples this rank's datasets served."""
    from megatron.data.datasets.t5_dataset import T5SpanCorruptionDataset

    served = [0]
    getitem = T5SpanCorruptionDataset.__getitem__

    def counting(self, index):
        served[0] += 1
        return getitem(self, index)

    T5SpanCorruptionDataset.__getitem__ = counting
    try:
        out = []
        for argv in argvs:
            served[0] = 0
            out += [{**result, "samples_read": served[0]}
                    for result in run_pretrain(rank, world_size, [argv])]
        return out
    finally:
        T5SpanCorruptionDataset.__getitem__ = getitem


def run_pretrain_until_error(rank, world_size, argvs):
    """As run_pretrain, but an exception ends the list: its result is {'error': type: message}
    (every rank reports its own)."""
    out = []
    for argv in argvs:
        try:
            out += run_pretrain(rank, world_size, [argv])
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append({"error": f"{type(e).__name__}: {e}"})
            break
    return out


def base_argv(data, *extra, model=None, iters=4):
    """A small run: 4 steps, global batch 4, 64 encoder tokens, evaluation every 2 steps."""
    return ["--data-path", data.prefix, "--tokenizer-model", data.spm,
            "--model-config", model or data.tiny, "--lr", "3e-3", "--lr-warmup-iters", "1",
            "--train-iters", str(iters), "--encoder-seq-length", "64", "--split", "90,5,5",
            "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "2",
            "--num-workers", "0", "--data-cache-path", data.cache, "--seed", "7",
            "--micro-batch-size", "2", "--global-batch-size", "4", *extra]


def losses(result):
    """A run's logged losses in step order."""
    return [result["losses"][i] for i in sorted(result["losses"])]


def assert_same_run(got, want, rtol, label=""):
    """Two 4-step runs agree: losses, gradient norms and evaluation losses (relative rtol).
    Every failure message starts with `label` (the run's flags) and shows both sides (pytest
    does not rewrite the asserts of this helper module)."""
    import pytest

    def same(name, a, b, rel):
        assert a == pytest.approx(b, rel=rel), f"{label}: {name} {a} != {b} (rel {rel})"

    assert sorted(got["losses"]) == sorted(want["losses"]) == [1, 2, 3, 4], \
        f"{label}: iterations {sorted(got['losses'])}"
    same("losses", losses(got), losses(want), rtol)
    same("gradient norms", [got["grad_norms"][i] for i in sorted(got["grad_norms"])],
         [want["grad_norms"][i] for i in sorted(want["grad_norms"])], max(rtol, 1e-4))
    assert [e[:2] for e in got["evals"]] == [e[:2] for e in want["evals"]], \
        f"{label}: evaluations {got['evals']} != {want['evals']}"
    same("evaluation losses", [e[2] for e in got["evals"]], [e[2] for e in want["evals"]], rtol)


def held_state(model) -> dict:
    """The state dict (float32 copies) of what `model` holds (a pipeline stage's model: the
    tensors of its parts, not the meta device's)."""
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()
            if not v.is_meta}


def decoding_state(module, config):
    """(held_state of the model validation decodes with, training/whole_model.py's: the module
    itself, a ZeRO-3 copy, a pipeline stage's; whether it is the trained module itself)."""
    from megatron.training.whole_model import stage_model, whole_model

    how = (config.model.make_vocab_size_divisible_by, config.model.attention_backend)
    if config.parallel.pipeline_model_parallel_size > 1:
        return held_state(stage_model(module, config.pipeline_cut(), *how).model), False
    with whole_model(module, *how) as copy:
        return held_state(copy), copy is module


def whole_model_state(rank, world_size, argv):
    """The entry point's step for `argv`, then `decoding_state` of its module."""
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed, set_seeds
    from megatron.pretrain_t5 import build_step
    from megatron.training.metrics import MetricsWriter
    from megatron.training.watchdog import NoWatchdog

    config = parse_args(argv, env=os.environ)
    initialize_distributed(config.runtime, config.parallel)
    try:
        set_seeds(config.runtime.seed, config.runtime.device_type)
        step = build_step(config, NoWatchdog(), MetricsWriter(None, None, enabled=False))
        return decoding_state(step.reporting_module(), config)
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def built_steps():
    """Within it, the entry point's steps in the order it builds them (a list; its
    build_step wrapped), so that a worker can look at the model after a run."""
    import megatron.pretrain_t5 as entry

    built = []
    build_step = entry.build_step

    def keeping(*args, **kwargs):
        built.append(build_step(*args, **kwargs))
        return built[-1]

    entry.build_step = keeping
    try:
        yield built
    finally:
        entry.build_step = build_step


def reference_model(argv, state):
    """A plain one-process T5Model (evaluation mode) of `argv`'s model flags holding `state`
    (run_keeping_model's), to recompute what a run reported."""
    from megatron.arguments import parse_args
    from megatron.model import T5Model

    config = parse_args(argv, env={})
    model = T5Model(config.model.t5, config.model.make_vocab_size_divisible_by)
    model.load_state_dict(state)
    return model.eval()


def split_batches(argv, split, count, size):
    """The first `count` batches of `size` samples of `split` of the run `argv` describes (the
    entry point's datasets, built without a process group), as tensors."""
    import torch

    from megatron.arguments import parse_args
    from megatron.data.datasets.t5_dataset import collate
    from megatron.training.loaders import build_run_datasets

    config = parse_args(argv, env={})
    dataset = build_run_datasets(config.data, config.batch)[split]
    return [{k: torch.from_numpy(v) for k, v in
             collate([dataset[i] for i in range(b * size, (b + 1) * size)]).items()}
            for b in range(count)]
