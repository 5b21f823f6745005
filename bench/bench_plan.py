"""The planner's step-time model against measured CPU steps: bench_training's ZeRO
configurations and bench_pipeline's layouts, predicted from this machine's measured constants.

    python bench/bench_plan.py [--calibrate-only] [--no-write]

1. Calibration: two processes under torchrun (gloo, one thread each, as the benches run), both
   measuring at once: the rate of a linear layer's forward and backward at the bench model's
   shapes for the encoder's and the decoder's row counts (fitted to the model's flops x rows /
   (rows + half_rows)), an element-wise add's bandwidth, torch's AdamW and DeepSpeed's CPU Adam
   per element (the trainer's two optimizers), a tensor copy, and gloo's all-reduce, all-gather,
   reduce-scatter and send/receive bandwidths and latency. None of it runs the model.
2. Prediction: each configuration as the planner sees it (`megatron.plan.search`: the trainer's
   flags resolved by `layout_from_flags`, the memory estimate for the activations, the time model
   of megatron/plan/timing.py) on a "cluster" of one node of 2 CPU processes.
3. Measurement: the step times that bench/bench_training.py and bench/bench_pipeline.py wrote to
   their WORK/results.json (run them first; this bench reads, it does not rerun them).

Reported: predicted / measured step time per configuration (goal: within 30%), and the ranking:
every pair of layouts of the same global batch whose measured times differ by more than the
measurement's own spread (NOISE, 10%, or the spread between the two benches' measurements of
the same layout if wider; such a layout counts once, at the mean of its two measurements) must
be ordered the same by the prediction. Results go to bench/RESULTS.md
(section "plan").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, WORK, machine_line, markdown_table, write_section  # noqa: E402

NOISE = 0.10
GOAL = 0.30
# bench_training's model and batch (bench/bench_training.py MODEL, MICRO_BATCH, ENC_LEN)
MICRO_BATCH, ENC_LEN, DEC_LEN, D_MODEL, D_FF = 4, 256, 58, 512, 1024


# Calibration (run in each of 2 processes) ----------------------------------------------------
def _timed(fn, repeat: int) -> float:
    """The fastest of `repeat` calls (after one warm-up), seconds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _linear_rate(rows: int) -> float:
    """FLOP/s of forward + backward of the bench model's linear layers at `rows` rows."""
    import torch

    total_flops, total_s = 0.0, 0.0
    for n, k in ((D_FF, D_MODEL), (D_MODEL, D_FF), (D_MODEL, D_MODEL)):
        x = torch.randn(rows, k, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True) * 0.02
        w = w.detach().requires_grad_()
        g = torch.randn(rows, n)

        def step():
            y = x @ w.t()
            y.backward(g)
        total_s += _timed(step, 5)
        total_flops += 3 * 2 * rows * n * k
    return total_flops / total_s


def _optimizer_seconds_per_element(kind: str) -> float:
    import torch

    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    if kind == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01)
    return _timed(opt.step, 3) / (16 << 20)


def _zero3_gather_bw(n: int) -> float:
    """DeepSpeed ZeRO-3's gathering of parameters in forward, as a bandwidth: the forward of a
    stack of the bench model's linear shapes (32 M fp32 parameters) under ZeRO-3 less under
    ZeRO 0, for (n - 1) / n of their bytes. Its hooks, allocations and all-gathers together:
    what the collective alone does not show."""
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    x = torch.randn(MICRO_BATCH * ENC_LEN, D_MODEL)
    forward = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[
            torch.nn.Linear(D_MODEL, D_FF, bias=False) if i % 2 == 0 else
            torch.nn.Linear(D_FF, D_MODEL, bias=False) for i in range(64)])
        nbytes = 4 * sum(p.numel() for p in model.parameters())
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            config={"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                    "zero_optimization": {"stage": stage}})
        times = []
        for _ in range(4):
            dist.barrier()
            start = time.perf_counter()
            loss = engine(x).pow(2).mean()
            times.append(time.perf_counter() - start)
            engine.backward(loss)
            engine.step()
        forward[stage] = min(times[1:])
    return (n - 1) / n * nbytes / max(forward[3] - forward[0], 1e-6)


def calibrate_worker(out: Path) -> None:
    """One of two processes: measure and (rank 0) write the constants."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    result: Dict[str, float] = {}
    dist.barrier()
    result["rate_encoder_rows"] = _linear_rate(MICRO_BATCH * ENC_LEN)
    result["rate_decoder_rows"] = _linear_rate(MICRO_BATCH * DEC_LEN)
    x, y, z = (torch.randn(16 << 20) for _ in range(3))
    result["elementwise_bw"] = 3 * x.numel() * 4 / _timed(lambda: torch.add(x, y, out=z), 5)
    result["copy_bw"] = x.numel() * 4 / _timed(lambda: z.copy_(x), 5)
    dist.barrier()
    result["adamw_s_per_element"] = _optimizer_seconds_per_element("torch")
    dist.barrier()
    result["cpu_adam_s_per_element"] = _optimizer_seconds_per_element("deepspeed")
    dist.barrier()
    small = torch.zeros(1)
    result["latency"] = _timed(lambda: dist.all_reduce(small), 50)
    big = torch.randn(32 << 20)  # 128 MiB, about the bench model's gradients
    nbytes = big.numel() * 4
    t = _timed(lambda: dist.all_reduce(big), 3)
    result["all_reduce"] = 2 * (n - 1) / n * nbytes / (t - result["latency"])
    gathered = torch.empty(n * big.numel())
    t = _timed(lambda: dist.all_gather_into_tensor(gathered, big), 3)
    result["all_gather"] = (n - 1) / n * n * nbytes / (t - result["latency"])
    part = torch.empty(big.numel() // n)
    t = _timed(lambda: dist.reduce_scatter_tensor(part, big), 3)
    result["reduce_scatter"] = (n - 1) / n * nbytes / (t - result["latency"])

    def ping():
        if rank == 0:
            dist.send(big, 1)
            dist.recv(big, 1)
        elif rank == 1:
            dist.recv(big, 0)
            dist.send(big, 0)
    result["p2p"] = 2 * nbytes / (_timed(ping, 3) - 2 * result["latency"])
    result["zero3_gather"] = _zero3_gather_bw(n)
    if rank == 0:
        out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def calibrate(work: Path) -> Dict[str, float]:
    out = work / "calibration.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", "29571", __file__, "--worker", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    cal = json.loads(out.read_text())
    cal["single_process_step"] = single_process_step(work)
    out.write_text(json.dumps(cal, indent=1))
    return cal


def single_process_step(work: Path, steps: int = 8, skip: int = 2) -> float:
    """The mean step of one-process training (ZeRO 0, micro batch 4, no data parallelism), two
    such runs at once so that both cores are busy as in the compared runs: what fixes the
    compute efficiency (the matrix products measured above reach only part of it: attention,
    norms, activations, the loss). Not one of the compared layouts."""
    from bench.common import STEP_RE, prepare_data, train_flags

    paths = prepare_data(work.parent / "training")
    flags = train_flags(paths, "model", steps, ["--zero-stage", "0"])
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-m", "megatron.pretrain_t5", *flags], cwd=REPO,
                              env=dict(env, MASTER_PORT=str(29581 + i)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    times = []
    for proc in procs:
        output = proc.communicate()[0]
        if proc.returncode != 0:
            sys.exit("single-process run failed:\n" + output[-3000:])
        found = [float(m.group(3)) for m in map(STEP_RE.match, output.splitlines()) if m]
        times += found[skip:]
    return sum(times) / len(times)


# Prediction ----------------------------------------------------------------------------------
def efficiency(cal: Dict[str, float], model_json: Path) -> float:
    """What the single-process step says of the compute: its measured time less the predicted
    optimizer step, over the compute predicted at the matrix products' measured rate."""
    single = ["--encoder-seq-length", str(ENC_LEN), "--micro-batch-size", str(MICRO_BATCH),
              "--global-batch-size", str(MICRO_BATCH), "--zero-stage", "0"]
    p = predict(model_json, {"single": single}, cal, world=1, efficiency=1.0)["single"]
    return p["compute"] / (cal["single_process_step"] - p["optimizer"])


def machine(cal: Dict[str, float], devices: int = 2, efficiency: float = 1.0):
    """The time model's Machine for one node of `devices` CPU processes, the matrix products
    at `efficiency` of their measured rate."""
    from megatron.plan.timing import CPU_ADAM_BYTES, OPTIMIZER_BYTES, Machine

    m1, m2 = MICRO_BATCH * ENC_LEN, MICRO_BATCH * DEC_LEN
    r1, r2 = cal["rate_encoder_rows"], cal["rate_decoder_rows"]
    # r = F m / (m + h) at two row counts: h = m1 m2 (r1 - r2) / (m1 r2 - m2 r1)
    denominator = m1 * r2 - m2 * r1
    half = max(m1 * m2 * (r1 - r2) / denominator, 0.0) if denominator > 0 else 0.0
    flops = r1 * (m1 + half) / m1 * efficiency
    return Machine(devices_per_node=devices, flops=flops, half_rows=half,
                   memory_bw=cal["elementwise_bw"],
                   optimizer_bw=OPTIMIZER_BYTES / cal["adamw_s_per_element"],
                   intra_bw=cal["all_reduce"], inter_bw=cal["all_reduce"],
                   host_link_bw=cal["copy_bw"],
                   host_memory_bw=devices * CPU_ADAM_BYTES / cal["cpu_adam_s_per_element"],
                   latency=cal["latency"],
                   collective_bw={k: cal[k] for k in ("all_reduce", "all_gather",
                                                      "reduce_scatter", "p2p", "zero3_gather")})


def predict(model_json: Path, flags_by_name: Dict[str, List[str]], cal: Dict[str, float],
            world: int = 2, efficiency: float = 1.0) -> Dict[str, dict]:
    """The planner's step time for each named set of layout flags on `world` CPU
    processes."""
    from megatron.plan.cluster import Cluster, Device
    from megatron.plan.search import Candidate, Evaluator

    device = Device("cpu process", 64.0, {"fp32": cal["rate_encoder_rows"] / 1e12}, 0, 0, 0, 0,
                    64.0)
    cluster = Cluster(1, world, device, inter_node_gbs=0, host_memory_gib=64.0,
                      device_type="cpu")
    evaluator = Evaluator(cluster, machine(cal, world, efficiency), headroom=0.0)
    out = {}
    for name, flags in flags_by_name.items():
        flags = ["--model-config", str(model_json)] + flags
        c = evaluator.evaluate(Candidate(0, 0, 0, 0, 0, "none", "none", False, flags))
        if c.problems:
            sys.exit(f"{name}: the planner refused the flags: {c.problems}")
        out[name] = {"total": c.time.total, **c.time.terms()}
    return out


# Measurements of the other benches -----------------------------------------------------------
def measured(work: Path) -> Dict[str, dict]:
    """{name: {"step": the fastest round's mean step (s), "flags": layout flags}} from
    bench_training's and bench_pipeline's results."""
    from bench.common import CONFIGS

    out = {}
    training = work.parent / "training" / "results.json"
    pipeline = work.parent / "pipeline" / "results.json"
    for path in (training, pipeline):
        if not path.exists():
            sys.exit(f"{path} is missing: run bench/{'bench_training' if path == training else 'bench_pipeline'}.py "
                     f"first")
    base = ["--encoder-seq-length", str(ENC_LEN), "--global-batch-size", "8"]
    flags = dict(CONFIGS)
    for row in json.loads(training.read_text())["rows"]:
        if row["name"] not in flags:
            continue  # bf16 (emulated on most CPUs) and the repeat of ZeRO 0
        out[f"training: {row['name']}"] = {
            "step": 1 / max(row["speeds"]),
            "flags": base + ["--micro-batch-size", str(MICRO_BATCH)] + flags[row["name"]]}
    layouts = {"DP=2, ZeRO 0": ["--micro-batch-size", "4", "--zero-stage", "0"],
               "ZeRO-3 DP=2": ["--micro-batch-size", "4", "--zero-stage", "3"],
               "PP=2": ["--micro-batch-size", "4", "--pipeline-model-parallel-size", "2"]}
    results = json.loads(pipeline.read_text())
    for row in results["speed"]:
        if row["name"] in layouts:
            out[f"pipeline: {row['name']}"] = {"step": 1 / max(row["speeds"]),
                                               "flags": base + layouts[row["name"]]}
    for row in results.get("bubble", []):
        m, mb = row["micro_batches"], row["micro_batch_size"]
        out[f"pipeline: PP=2, m = {m}"] = {
            "step": row.get("step_s"),
            "flags": ["--encoder-seq-length", str(ENC_LEN), "--global-batch-size", str(m * mb),
                      "--micro-batch-size", str(mb), "--pipeline-model-parallel-size", "2"]}
    return {k: v for k, v in out.items() if v["step"]}


REPEATS = (("training: ZeRO 0", "pipeline: DP=2, ZeRO 0"),
           ("training: ZeRO 3", "pipeline: ZeRO-3 DP=2"))
"""The same layout measured by both benches: how far apart two measurements of one thing
fall."""


def noise(meas: Dict[str, float]) -> float:
    """The ranking's tie margin: NOISE, or the spread between repeated measurements if wider."""
    spreads = [abs(meas[a] - meas[b]) / min(meas[a], meas[b]) for a, b in REPEATS
               if a in meas and b in meas]
    return max([NOISE] + spreads)


def merged(meas: Dict[str, float]) -> Dict[str, float]:
    """One entry per layout: a layout both benches measured counts once, at the mean of the
    two (under the first name)."""
    out = dict(meas)
    for a, b in REPEATS:
        if a in out and b in out:
            out[a] = (out[a] + out.pop(b)) / 2
    return out


def ranking_disagreements(pred: Dict[str, float], meas: Dict[str, float],
                          groups: Dict[str, int], margin: float) -> List[str]:
    """Pairs of layouts of the same global batch (the planner ranks layouts of one request)
    whose measured times differ by more than `margin` but whose predicted order is the other
    way round."""
    names, bad = sorted(meas), []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if groups[a] != groups[b] or abs(meas[a] - meas[b]) <= margin * min(meas[a],
                                                                                 meas[b]):
                continue
            if (meas[a] < meas[b]) != (pred[a] < pred[b]):
                bad.append(f"{a} / {b}")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=WORK / "plan")
    parser.add_argument("--calibrate-only", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="the last calibration")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.worker:
        calibrate_worker(args.worker)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    cal = json.loads((args.work / "calibration.json").read_text()) if args.reuse else calibrate(args.work)
    print(json.dumps(cal, indent=1))
    if args.calibrate_only:
        return 0
    runs = measured(args.work)
    model_json = args.work.parent / "training" / "model.json"
    eff = efficiency(cal, model_json)
    print(f"compute efficiency: {eff:.3f} of the matrix products' rate")
    pred = predict(model_json, {k: v["flags"] for k, v in runs.items()}, cal, efficiency=eff)
    rows = []
    for name, run in runs.items():
        p = pred[name]
        rows.append((name, run, p, p["total"] / run["step"]))
        print(f"{name}: measured {run['step']:.3f} s, predicted {p['total']:.3f} s "
              f"({p['total'] / run['step']:.2f})")
    meas = {k: v["step"] for k, v in runs.items()}
    margin = noise(meas)
    groups = {k: v["flags"][v["flags"].index("--global-batch-size") + 1]
              for k, v in runs.items()}
    bad = ranking_disagreements({k: v["total"] for k, v in pred.items()}, merged(meas),
                                groups, margin)
    print(f"ranking disagreements beyond {100 * margin:.0f}%:", bad or "none")
    if not args.no_write:
        write_section("plan", report(rows, bad, margin, cal, eff, time.time() - start))
    return 0


def report(rows, bad, margin, cal, eff, wall_s) -> str:
    worst = max(abs(r[3] - 1) for r in rows)
    lines = [
        "## plan (the planner's step-time model against measured CPU steps)", "",
        f"Command: `python bench/bench_plan.py` ({wall_s / 60:.1f} min), after "
        "`python bench/bench_training.py` and `python bench/bench_pipeline.py` on the same "
        "machine (their step times: the fastest of their 2 rounds)", "", machine_line(), "",
        "Calibration, this machine's constants (2 gloo processes, one thread each, measuring at "
        "once): linear layers' forward + backward at the bench model's shapes "
        f"{cal['rate_encoder_rows'] / 1e9:.1f} GFLOP/s at {MICRO_BATCH * ENC_LEN} rows, "
        f"{cal['rate_decoder_rows'] / 1e9:.1f} at {MICRO_BATCH * DEC_LEN}; element-wise "
        f"{cal['elementwise_bw'] / 1e9:.1f} GB/s; torch AdamW "
        f"{cal['adamw_s_per_element'] * 1e9:.2f} ns and DeepSpeed CPU Adam "
        f"{cal['cpu_adam_s_per_element'] * 1e9:.2f} ns per element; gloo all-reduce "
        f"{cal['all_reduce'] / 1e9:.2f}, all-gather {cal['all_gather'] / 1e9:.2f}, "
        f"reduce-scatter {cal['reduce_scatter'] / 1e9:.2f}, send/recv {cal['p2p'] / 1e9:.2f} "
        f"GB/s (128 MiB), latency {cal['latency'] * 1e6:.0f} us; DeepSpeed ZeRO-3's forward "
        f"gathering (hooks included) {cal['zero3_gather'] / 1e9:.2f} GB/s, from a stack of "
        "linear layers. Compute efficiency: a one-process run of the bench model (ZeRO 0, no "
        f"data parallelism; not one of the layouts below) took {cal['single_process_step']:.3f}"
        f" s a step, so the model's compute runs at {eff:.3f} of the linear layers' rate "
        "(attention, norms, activations and the loss are the rest).", ""]
    lines += markdown_table(
        ["configuration", "measured step (s)", "predicted (s)", "predicted / measured",
         "compute", "TP comm", "bubble", "DP/ZeRO comm", "optimizer", "offload"],
        [[name, f"{run['step']:.3f}", f"{p['total']:.3f}", f"**{ratio:.2f}**",
          *(f"{p[k]:.3f}" for k in ("compute", "tp_comm", "pp_bubble", "dp_comm", "optimizer",
                                    "offload"))] for name, run, p, ratio in rows])
    order = sorted(rows, key=lambda r: r[1]["step"])
    lines += ["", f"Largest deviation: {100 * worst:.0f}% (goal: within {100 * GOAL:.0f}%).", "",
              "Ranking (global batch 8; m = 1 and m = 8 have other batches): measured, fastest "
              "first: " + ", ".join(f"{r[0]} {r[1]['step']:.2f}" for r in order
                                    if "m = 1" not in r[0] and "m = 8" not in r[0]) + ". "
              "Predicted: " + ", ".join(f"{r[0]} {r[2]['total']:.2f}" for r in sorted(
                  rows, key=lambda r: r[2]["total"]) if "m = 1" not in r[0]
                  and "m = 8" not in r[0]) + ". "
              f"Pairs measured more than {100 * margin:.0f}% apart (the larger of 10% and the "
              "spread between the two benches' measurements of the same layout, such a layout "
              "counted once at their mean) that the prediction orders the other way: "
              f"{', '.join(bad) if bad else 'none'}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
