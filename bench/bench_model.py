"""T5 training-step throughput on CPU: ours vs Hugging Face's T5ForConditionalGeneration.

    python bench/bench_model.py [--steps 9] [--batch 8] [--threads 2]

One process, the same config, weights and batch for both: d_model 256, 4 + 4 layers, 4 heads
of 64, d_ff 1024, gated-gelu, untied, vocabulary 32128, inputs 512 / targets 128, batch 8, in
training mode with dropout 0 (T5 v1.1 was pretrained without dropout) and 0.1. A step is forward, loss and backward (no optimizer: it is the same
for both). Steps alternate between the two models; the median of `--steps` timed steps after two
warm-up steps is reported, in fp32 and, where the CPU has bf16 instructions, with bf16 autocast,
each with dropout 0 and 0.1 (goal: ours at least 1.3x Hugging Face in every row). Achieved GFLOP/s
use the encoder-decoder formula of megatron/model/flops.py, against this machine's matmul peak
measured here (a 2048^3 GEMM). `--profile` adds each model's five most expensive torch ops (self
CPU time over two steps, torch.profiler) in fp32 with dropout 0, and each model's GEMM floor:
the matrix products its step dispatches, replayed alone (what that step would cost if everything
but torch's GEMM kernels were free). Results go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_line, write_section  # noqa: E402
from megatron.model import T5Config, T5Model  # noqa: E402
from megatron.model.flops import training_step_flops  # noqa: E402
from megatron.model.state_dict import from_hf_state_dict, load_full_state_dict  # noqa: E402
from megatron.tensor_parallel import model_parallel_seed  # noqa: E402

FIELDS = dict(vocab_size=32128, d_model=256, d_kv=64, d_ff=1024, num_layers=4,
              num_decoder_layers=4, num_heads=4, feed_forward_proj="gated-gelu",
              tie_word_embeddings=False, dropout_rate=0.1)
ENC_LEN, DEC_LEN = 512, 128


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions; without them torch emulates bf16 GEMMs,
    tens of times slower than fp32, and a bf16 timing says nothing about the model."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build(backend: str, dropout: float):
    from transformers import T5Config as HFConfig
    from transformers import T5ForConditionalGeneration

    model_parallel_seed(0)
    fields = dict(FIELDS, dropout_rate=dropout)
    hf = T5ForConditionalGeneration(HFConfig(**fields))
    hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight))  # untie (5.x)
    ours = T5Model(T5Config(**fields), attention_backend=backend)
    load_full_state_dict(ours, from_hf_state_dict(hf.state_dict(), ours.config))
    return hf.train(), ours.train()


def batch(size: int):
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(2, 32100, (size, ENC_LEN), generator=g)
    labels = torch.randint(2, 32100, (size, DEC_LEN), generator=g)
    dec = torch.cat([torch.zeros(size, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return enc, dec, labels


def step_functions(hf, ours, data, bf16: bool) -> dict:
    """One training step (forward, loss, backward) of each model on `data`."""
    enc, dec, labels = data
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())

    def step_hf():
        hf.zero_grad(set_to_none=True)
        with autocast:
            loss = hf(input_ids=enc, decoder_input_ids=dec, labels=labels).loss
        loss.backward()

    def step_ours():
        ours.zero_grad(set_to_none=True)
        with autocast:
            loss = ours(enc, dec, labels=labels).loss
        loss.backward()

    return {"hf": step_hf, "ours": step_ours}


def measure(hf, ours, data, steps: int, bf16: bool):
    step = step_functions(hf, ours, data, bf16)
    times = {"hf": [], "ours": []}
    for i in range(steps + 2):
        for name, fn in step.items():
            elapsed = _timed(fn)
            if i >= 2:
                times[name].append(elapsed)
    medians = {k: statistics.median(v) for k, v in times.items()}
    # The machine's speed drifts; a step of one model and the next of the other see the same
    # conditions, so the speed-up is the median of those pairs' ratios.
    medians["speedup"] = statistics.median(h / o for h, o in zip(times["hf"], times["ours"]))
    return medians


def top_ops(steps: dict, count: int = 5) -> str:
    """Each model's `count` torch ops with the most self CPU time over two of its `steps`
    (`step_functions`), as Markdown table rows (the profiler's overhead inflates small ops; the
    order is what counts)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for key, step in steps.items():
        name = "ours" if key == "ours" else "Hugging Face"
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            step()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        for rank, event in enumerate(events[:count], 1):
            rows.append(f"| {name} | {rank} | `{event.key}` | {event.self_cpu_time_total / 2e3:.0f} "
                        f"| {event.self_cpu_time_total / total:.0%} | {event.count // 2} |")
    return "\n".join(rows)


_GEMMS = ("mm", "bmm", "addmm", "baddbmm")


def gemm_replay(step) -> tuple:
    """(replay, call count): `replay()` runs the matrix products that one call of `step`
    dispatches (mm, bmm, addmm, baddbmm, forward and backward) on random operands with the same
    shapes, strides and dtypes, with nothing else between them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def spec(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), value.dtype)
        return value

    def operand(value):
        if not (isinstance(value, tuple) and value[:1] == ("tensor",)):
            return value
        _, shape, stride, dtype = value
        extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
        return torch.randn(extent, dtype=dtype).as_strided(shape, stride)

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in _GEMMS:
                self.calls.append((func, [spec(a) for a in args],
                                   {k: spec(v) for k, v in kwargs.items()}))
            return func(*args, **kwargs)

    record = Record()
    with record:
        step()
    calls = [(func, [operand(a) for a in args], {k: operand(v) for k, v in kwargs.items()})
             for func, args, kwargs in record.calls]

    def replay():
        for func, args, kwargs in calls:
            func(*args, **kwargs)

    return replay, len(calls)


FLOOR_REPEATS = 5


def gemm_floor(steps: dict, repeats: int = FLOOR_REPEATS) -> dict:
    """Each model's GEMM replay (`gemm_replay`), the two timed in turn `repeats` times: their
    medians in seconds (the steps' own are measure's) and call counts."""
    replays = {name: gemm_replay(fn) for name, fn in steps.items()}
    times = {name: [] for name in replays}
    for round_ in range(repeats + 1):
        for name, (replay, _) in replays.items():
            elapsed = _timed(replay)
            if round_:  # the first round warms up
                times[name].append(elapsed)
    return {name: (statistics.median(times[name]), replays[name][1]) for name in replays}


def floor_text(times: dict, floors: dict) -> str:
    """Markdown: each model's fp32 dropout-0 step (measure's medians) against its GEMM floor, and
    what the 1.3x goal leaves ours for everything that is not a GEMM."""
    rows = "\n".join(
        f"| {'ours' if name == 'ours' else 'Hugging Face'} | {times[name]:.3f} | "
        f"{floors[name][0]:.3f} ({floors[name][1]} calls) | "
        f"{times[name] - floors[name][0]:.3f} |" for name in ("ours", "hf"))
    return f"""
GEMM floor (fp32, dropout 0): the matrix products each step dispatches (forward and backward),
replayed alone on operands of the same shapes and strides (`gemm_floor`, the two models' replays
in turn, medians of {FLOOR_REPEATS}), beside the steps of the table above:

| model | s/step | its GEMMs alone, s | the rest of the step, s |
| --- | ---: | ---: | ---: |
{rows}

1.3x over this Hugging Face step allows ours {times['hf'] / 1.3:.3f} s; ours' GEMMs alone take
{floors['ours'][0]:.3f} s. With torch's GEMM kernels, ours cannot pass
**{times['hf'] / floors['ours'][0]:.2f}x** here (Hugging Face's step over ours' GEMMs alone) even
if all of its other work cost nothing.
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "eager", "sdpa"])
    parser.add_argument("--bf16", choices=["auto", "yes", "no"], default="auto",
                        help="also time bf16 autocast (auto: when the CPU has bf16 instructions)")
    parser.add_argument("--profile", action="store_true",
                        help="also list each model's five costliest ops (fp32, dropout 0)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    data = batch(args.batch)
    with_bf16 = args.bf16 == "yes" or (args.bf16 == "auto" and native_bf16())
    runs = [(0.0, "fp32", False, torch.float32), (0.1, "fp32", False, torch.float32)]
    if with_bf16:
        runs += [(0.0, "bf16 autocast", True, torch.bfloat16),
                 (0.1, "bf16 autocast", True, torch.bfloat16)]
    rows, speedups, padded = [], {}, None
    for dropout, label, bf16, dtype in runs:
        hf, ours = build(args.backend, dropout)
        padded = ours.padded_vocab_size
        flops = training_step_flops(ours.config, args.batch, ENC_LEN, DEC_LEN, padded)
        peak = matmul_peak(dtype)
        t = measure(hf, ours, data, args.steps, bf16)
        speedups[dropout, label] = t["speedup"]
        for name in ("ours", "hf"):
            gflops = flops.model / t[name] / 1e9
            rows.append(f"| {label} | {dropout} | {'ours' if name == 'ours' else 'Hugging Face'} "
                        f"| {t[name]:.3f} | {args.batch * ENC_LEN / t[name]:,.0f} | "
                        f"{args.batch * DEC_LEN / t[name]:,.0f} | {gflops:.1f} | "
                        f"{gflops / peak:.0%} of {peak:.0f} |")
        if args.profile and dropout == 0.0 and not bf16:
            fp32_steps = step_functions(hf, ours, data, False)
            profile_rows = top_ops(fp32_steps)
            floor_part = floor_text(t, gemm_floor(fp32_steps))
        del hf, ours
    if with_bf16:
        bf16_line = (f"With bf16 autocast: **{speedups[0.0, 'bf16 autocast']:.2f}x** with dropout "
                     f"off, **{speedups[0.1, 'bf16 autocast']:.2f}x** with dropout 0.1.")
    else:
        bf16_line = (f"bf16 not timed: this CPU has no bf16 matrix instructions, so torch "
                     f"emulates bf16 GEMMs ({matmul_peak(torch.bfloat16, 512, 2):.1f} GFLOP/s "
                     f"here against {matmul_peak(torch.float32, 512, 2):.0f} in fp32) and a "
                     "timing would measure the emulation. `--bf16 yes` forces it; the bf16 "
                     "path's correctness is tested (tests/unit/test_hf_parity.py).")
    command = "python bench/bench_model.py" + (f" --steps {args.steps}" if args.steps != 9
                                               else "") + (" --profile" if args.profile else "")
    profile_part = "" if not args.profile else f"""
The five ops with the most self CPU time per step (torch.profiler over two steps, fp32, dropout 0;
the profiler's own overhead inflates the small ops):

| model | rank | op | ms per step | of the step's op time | calls per step |
| --- | ---: | --- | ---: | ---: | ---: |
{profile_rows}
{floor_part}"""
    body = f"""## T5 model training step (one process, CPU)

Command: `{command}`
Machine: {machine_line()}, {args.threads} threads, torch {torch.__version__}. Config: d_model 256,
4 + 4 layers, 4 heads x 64, d_ff 1024, gated-gelu, untied, vocab 32128 (ours padded to
{padded}), inputs {ENC_LEN} / targets {DEC_LEN}, batch {args.batch}; dropout 0 (T5 v1.1's
pretraining recipe) and 0.1. Forward + loss + backward, median of {args.steps} steps, the two
models alternating on the same weights and batch; the speed-up is the median ratio of adjacent
steps (this machine's speed drifts between runs). Attention backend `{args.backend}`.
GFLOP/s from the encoder-decoder formula ({flops.model / 1e9:.1f} GFLOP per step) against the
measured matmul peak.

| precision | dropout | model | s/step | input tokens/s | target tokens/s | GFLOP/s | of matmul peak |
| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

Speed-up over Hugging Face in fp32: **{speedups[0.0, 'fp32']:.2f}x** with dropout off,
**{speedups[0.1, 'fp32']:.2f}x** with dropout 0.1 (goal >= 1.3x).
{bf16_line}
{profile_part}"""
    print(body)
    if not args.no_write:
        write_section("model", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
