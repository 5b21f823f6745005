"""The GPU acceptance benchmark (`make gpu-check`): tokens/s, TFLOP/s and MFU of training steps of
a T5-Large-class model (configs/model/t5-v1_1-large.json, bf16, dropout 0) on one CUDA GPU for
the attention backends eager, sdpa and flex, printed as one table (bench/RESULTS.md takes it).

    python bench/bench_gpu.py [--batch 8] [--encoder-length 512] [--steps 10]

On a machine without CUDA it says so and exits 0 without measuring anything."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default="configs/model/t5-v1_1-large.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--encoder-length", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return 0
    from megatron.data.datasets.span_corruption import expected_lengths
    from megatron.model import T5Config, T5Model
    from megatron.model.flops import training_step_flops
    from megatron.training.metrics import peak_tflops

    config = T5Config.from_json(args.model_config)
    config = T5Config.from_dict({**config.to_dict(), "dropout_rate": 0.0})
    dec_len = expected_lengths(args.encoder_length)[1]
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name, "bf16")
    flops = training_step_flops(config, args.batch, args.encoder_length, dec_len,
                                config.padded_vocab_size(128, 1)).model
    rows = []
    for backend in ("eager", "sdpa", "flex"):
        torch.manual_seed(0)
        model = T5Model(config, attention_backend=backend).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        enc = torch.randint(2, config.vocab_size, (args.batch, args.encoder_length),
                            device="cuda")
        dec = torch.randint(2, config.vocab_size, (args.batch, dec_len), device="cuda")

        def step():
            opt.zero_grad(set_to_none=True)
            model(enc, dec, labels=dec).loss.backward()
            opt.step()
        for _ in range(3):  # warm-up (flex compiles here)
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        tflops = flops / seconds / 1e12
        rows.append((backend, args.batch * (args.encoder_length + dec_len) / seconds, tflops,
                     tflops / peak if peak else float("nan"),
                     torch.cuda.max_memory_allocated() / 2 ** 30))
        del model, opt
        torch.cuda.empty_cache()
    print(f"{name}, {args.model_config}, batch {args.batch}, {args.encoder_length}/{dec_len} "
          f"tokens, bf16, {args.steps} steps after 3 warm-up")
    print(f"{'backend':<8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for backend, tokens, tflops, mfu, mem in rows:
        print(f"{backend:<8} {tokens:>10.0f} {tflops:>8.1f} {mfu:>6.1%} {mem:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
