"""Encoder self-attention of T5 (relative bias, padding) on the CPU: forward time and peak
allocated memory at encoder lengths 512, 2048 and 4096 for the backends eager (the bias added
inside the score GEMM), sdpa (the bias materialized as the attn_mask) and flex (the bias computed
inside FlexAttention from the [buckets, heads] table: no [batch, heads, q, k] tensor).

    python bench/bench_attention.py [--lengths 512 2048 4096] [--heads 8] [--batch 1]

Peak memory: torch.profiler's allocation events during one more call (the bias, the mask and the
scores counted; the inputs made before). flex runs compiled (its first call per length compiles,
left out of the timing). Figures go to bench/RESULTS.md ("attention")."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import allocated, machine_line, write_section  # noqa: E402
from megatron.model import T5Config  # noqa: E402
from megatron.model.flex import FlexBias, flex_core_attention  # noqa: E402
from megatron.model.t5 import additive_encoder_mask  # noqa: E402
from megatron.model.transformer import (  # noqa: E402
    InitMethods,
    core_attention,
    relative_attention_bias,
    relative_bias,
    stack_position_bias,
)
from megatron.tensor_parallel.group import SINGLE  # noqa: E402

MIB = 2 ** 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-kv", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    config = T5Config(d_model=args.heads * args.d_kv, d_kv=args.d_kv, num_heads=args.heads,
                      relative_attention_num_buckets=32, relative_attention_max_distance=128)
    table = relative_attention_bias(config, InitMethods(config, 1), False, SINGLE)
    rows = []
    for length in args.lengths:
        q, k, v = (torch.randn(args.batch, args.heads, length, args.d_kv) for _ in range(3))
        attention = torch.ones(args.batch, length, dtype=torch.long)
        attention[:, length - length // 8:] = 0  # an eighth of padding
        mask = additive_encoder_mask(attention)
        hidden = torch.empty(args.batch, length, 1)

        def materialized(use_sdpa):
            def run():
                with torch.no_grad():
                    bias = stack_position_bias(
                        lambda a, b: relative_bias(table, config, False, a, b), mask, hidden)
                    return core_attention(q, k, v, bias, 0.0, use_sdpa)
            return run

        def flex():
            with torch.no_grad():
                return flex_core_attention(q, k, v, FlexBias(
                    table.weight.detach(), True, 32, 128, attention.bool(), False))

        for name, fn in (("eager", materialized(False)), ("sdpa", materialized(True)),
                         ("flex", flex)):
            fn()  # warm-up (flex: compiles)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            peak = allocated(fn)["peak"]
            rows.append((length, name, statistics.median(times) * 1e3, peak / MIB))
            print(f"length {length:>5} {name:<6} {rows[-1][2]:>9.1f} ms {rows[-1][3]:>9.1f} MiB",
                  flush=True)
    lines = ["| length | backend | forward ms | peak allocated MiB |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {b} | {t:.1f} | {m:.1f} |" for n, b, t, m in rows]
    body = (f"## attention\n\n`python bench/bench_attention.py` (batch {args.batch}, "
            f"{args.heads} heads of {args.d_kv}, an eighth of the keys padding, fp32, forward "
            f"only, no grad) on {machine_line()}, torch {torch.__version__}:\n\n"
            + "\n".join(lines) + "\n\n"
            "eager and sdpa hold the [batch, heads, q, k] bias (and eager its scores) whatever "
            "the kernel; flex keeps only its output and the block mask: its peak grows with the "
            "length, not with heads x length^2.\n")
    write_section("attention", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
