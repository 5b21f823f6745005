"""The report of bench/bench_moe.py (bench/RESULTS.md, section moe) from its saved figures, and
the settings of the runs that the report describes."""

from __future__ import annotations

import statistics
from typing import List

from bench.common import gib, markdown_table

A_ENC_LEN, A_MICRO, A_GLOBAL = 128, 8, 16
A_SKIP = 5
LAYER = dict(d_model=512, d_ff=1024, experts=8, length=256)
"""(b): the shapes (bench_training's model's feed-forward)."""
CAPACITY = 1.25
MIB = 2 ** 20

PARTS = ("forward", "backward", "optimizer", "all_reduce", "a2a")
"""What the worker times inside each training step, from the library's named ranges
(megatron/training/timing.py): DeepSpeed's engine forward, backward (with the gradients'
all-reduce at its end under ZeRO 0) and step (the optimizer), DeepSpeed's gradient all-reduce
(`allreduce_gradients`) and moe.py's all-to-all."""


def _median_step(row: dict) -> float:
    """The fastest round's median step time."""
    return min(row["speeds"])


def report(results: dict) -> str:
    parts = ["## moe (Mixture-of-Experts on CPU: dense against MoE, our layer against "
             "DeepSpeed's, EP=2 against EP=1)"]
    if "a" in results:
        parts.append(report_training(results["a"]))
    if "b" in results:
        parts.append(report_layers(results["b"]))
    if "c" in results:
        parts.append(report_expert_parallel(results["c"]))
    return "\n\n".join(part.strip() for part in parts) + "\n"


def _header(part: dict) -> str:
    return (f"Command: `{part['command']}` ({part['wall_s'] / 60:.1f} min, {part['when']})\n"
            f"Machine: {part['machine']}.")


def report_training(a: dict) -> str:
    rows = a["rows"]
    dense = rows[0]
    iterations = sorted({int(it) for r in rows for it in r["evals"]})
    evals = []
    for it in iterations:
        cells = [it]
        for r in rows:
            loss = r["evals"].get(str(it), r["evals"].get(it))
            diff = "" if r is dense or loss is None else \
                f" ({loss - dense['evals'].get(str(it), dense['evals'].get(it)):+.3f})"
            cells.append("" if loss is None else f"{loss:.3f}{diff}")
        evals.append(cells)
    lines = markdown_table(["step"] + [r["name"] for r in rows], evals, "r" * (len(rows) + 1))
    steps = len(dense["losses"])
    tail = min(50, steps)
    timed = [r for r in rows if r["speeds"]]
    speed_rows = []
    for r in rows:
        last = [v for it, v in r["losses"].items() if int(it) > steps - tail]
        timing = [f"{_median_step(r):.3f}", " / ".join(f"{v:.3f}" for v in r["speeds"]),
                  " / ".join(f"{v:.2f}" for v in r["others"]),
                  f"**{_median_step(r) / _median_step(dense):.2f}**",
                  f"{gib(r['hwm'][0])} / {gib(r['hwm'][1])}"] if r["speeds"] else \
            ["(not timed)", None, None, None, None]
        speed_rows.append([r["name"], f"{r['sparse'][0]} + {r['sparse'][1]}",
                           f"{r['parameters'] / 1e6:.2f} M",
                           f"{r['expert_parameters'] / 1e6:.2f} M", f"{r['flops'] / 1e9:.2f}",
                           f"{statistics.mean(last):.3f}", *timing])
    speed = markdown_table(
        ["run", "sparse blocks (encoder + decoder)", "parameters", "of them experts",
         "active GFLOP per step", f"training loss, mean of the last {tail} steps",
         "median step (s)", "rounds (s)", "others' CPU (cores)", "vs dense",
         "peak RSS rank 0 / 1 (GiB)"], speed_rows)
    parts = markdown_table(
        ["run", "step (ms)", "forward", "backward", "optimizer",
         "all-reduce (in backward and optimizer)", "all-reduce MiB"],
        [[r["name"], *(f"{1e3 * r['parts'][k]:.0f}" for k in
                       ("wall", "forward", "backward", "optimizer", "all_reduce")),
          f"{r['parts']['all_reduce_mib']:.1f}"] for r in timed])
    balance = []
    for r in rows[1:]:
        b = r["balance"]
        if b:
            balance.append(f"{r['name']}: " + ", ".join(f"{x:.2f}" for x in b["first"])
                           + f" in the first {b['window']} steps, "
                           + ", ".join(f"{x:.2f}" for x in b["last"]) + " in the last "
                           f"{b['window']} (choices dropped: {b['dropped']:.0f})")
    noise = _noise(rows)
    return f"""### (a) dense against top-1 MoE, trained the same number of steps

{_header(a)}
Two processes (`torchrun --nproc_per_node 2`, gloo, one thread each), the flags of
launch/quickstart.sh's run: configs/model/t5-demo.json's shape (d_model 128, 4 heads x 32, d_ff
512 gated-gelu, 2 + 2 layers, untied) with the bench tokenizer's vocabulary (8100, padded to
8192) and dropout 0, encoder {A_ENC_LEN} / decoder {dense['decoder_seq_length']} tokens (span
corruption), micro batch {A_MICRO} per rank, global batch {A_GLOBAL}, AdamW, lr 3e-3, 20 warm-up
steps, cosine to 3e-4, ZeRO 0, fp32, {steps} steps ({steps * A_GLOBAL * A_ENC_LEN / 1e6:.2f} M
encoder tokens). Data: the English test corpora (3.6 MB, 0.9 M tokens), SentencePiece 8000
pieces + 100 sentinels, split 95/5/0. MoE: `--num-experts 8 --moe-router-type switch` (top-1,
output scaled by its probability), dropless (the default), balancing losses at their defaults
(aux 1e-2, z 1e-3), every block's feed-forward sparse; "every second block" adds
`--moe-encoder-sparse-step 2 --moe-decoder-sparse-step 2` (Switch Transformer's layout: block 1
of each stack). Top-1 runs one expert per token, so the active FLOPs (megatron/model/flops.py)
are the dense model's plus the router's. Same --seed: the same training batches, and every
evaluation is over the same first {a['eval_iters']} global batches of the validation split
({a['eval_iters'] * A_GLOBAL} samples); "dense, other initial weights" is the dense run with its
weights drawn from another seed (the bench's worker offsets the seed of init_rng only), the
measure of run-to-run noise. Losses: the LM loss (cross-entropy per target token), without the
balancing losses. Speed, from separate runs of {a['speed_steps']} steps without evaluation (the
same flags otherwise), {a['speed_rounds']} rounds (all configurations, then all again): rank 0's
wall time in the trainer's step (DataParallelStep.step: forward, backward, all-reduce,
optimizer; the log line rounds it to 10 ms), the median after step {A_SKIP}; the fastest round
counts. "others' CPU": the cores other jobs kept busy during each round's run.

Validation loss (in brackets: against dense at the same step):

{chr(10).join(lines)}

{noise.strip()}

{chr(10).join(speed)}

Where rank 0's step goes (ms, the mean after step {A_SKIP} in the fastest round; DeepSpeed's
engine forward, backward and step, and the time inside DeepSpeed's gradient all-reduce
(allreduce_gradients, which ZeRO 0 calls at the end of the backward; timed through the trainer's
named ranges, megatron/training/timing.py):

{chr(10).join(parts)}

{_step_costs(timed)}

Expert load, the busiest expert's share of the token choices over the even share (1.00:
balanced; 8.00: every token to one expert), per sparse layer (encoder first), both ranks' tokens:
{'; '.join(balance)}.
"""


def _gaps(row: dict, dense: dict) -> List[float]:
    return [row["evals"][it] - dense["evals"][it] for it in dense["evals"] if it in row["evals"]]


def _noise(rows: List[dict]) -> str:
    """What the validation losses say, against the two dense runs' spread."""
    dense = rows[0]
    reference = next((r for r in rows if r.get("init_offset")), None)
    if reference is None:
        return ""
    spread = max(abs(g) for g in _gaps(reference, dense))
    moe = [r for r in rows[1:] if r is not reference]
    listed = ", ".join(f"{g:+.3f}" for g in _gaps(reference, dense))
    text = (f"The two dense runs (other initial weights, the same data and evaluation batches) "
            f"differ by up to {spread:.3f} ({listed} at the evaluations above).")
    beyond = [r["name"] for r in moe if max(abs(g) for g in _gaps(r, dense)) > spread]
    last = {r["name"]: _gaps(r, dense)[-1] for r in moe}
    ending = "; ".join(f"{name} {gap:+.3f}" for name, gap in last.items())
    if beyond:
        return text + f" Beyond that: {', '.join(beyond)}. At the last evaluation: {ending}."
    return (text + " **No MoE run is further from dense than that at any evaluation**: in this "
            "run, the MoE does not reach a lower loss per step than the dense model by more "
            f"than the run-to-run noise (at the last evaluation: {ending}).")


def _step_costs(timed: List[dict]) -> str:
    dense = timed[0]["parts"]
    out = []
    for r in timed[1:]:
        k = r["parts"]
        more = {p: 1e3 * (k[p] - dense[p]) for p in ("wall", "forward", "backward",
                                                        "optimizer", "all_reduce")}
        out.append(f"{r['name']}: {more['wall']:+.0f} ms a step against dense, forward "
                   f"{more['forward']:+.0f}, backward {more['backward']:+.0f} (of it all-reduce "
                   f"{more['all_reduce']:+.0f}), optimizer {more['optimizer']:+.0f}")
    return ("The same active FLOPs do not make the same step: " + "; ".join(out) + ". The "
            "all-reduce and the optimizer scale with all the parameters (the experts' "
            "included), not with the active ones; and on the CPU torch's grouped_mm runs one small "
            "matrix multiply per expert where the dense layer runs one large one.")


def report_layers(b: dict) -> str:
    table, checks = [], []
    for r in b["rows"]:
        tokens = r["batch"] * LAYER["length"]
        cap = (f"factor {r['capacity']}" if r["capacity"] is not None else "dropless")
        for name, label in (("ours", "ours (SparseMLP)"), ("deepspeed", "DeepSpeed MoE")):
            t, memory = r["times"][name], r["memory"][name]
            ratio = [f"**{r['speedup']:.2f}x**", f"{r['others']:.2f}"] if name == "ours" \
                else ["", ""]
            table.append([f"{tokens} ({r['batch']} x {LAYER['length']})", cap, label,
                          f"{statistics.median(t) * 1e3:.1f}",
                          f"{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}", *ratio,
                          f"{memory['peak'] / MIB:.1f}", f"{memory['held'] / MIB:.1f}",
                          f"{100 * r['dropped'][name]:.1f}%"])
        if "max_difference" in r:
            d = r["max_difference"]
            checks.append(f"{tokens} tokens: output {d['output']:.1e}, input gradient "
                          f"{d['input_grad']:.1e}")
    lines = markdown_table(
        ["tokens per call", "capacity", "layer", "fwd + bwd (ms)", "min-max (ms)",
         "DeepSpeed / ours", "others' CPU (cores)", "peak allocated (MiB)",
         "held after the call (MiB)", "choices dropped"], table, "rllrrrrrrr")
    d_model, d_ff, experts = LAYER["d_model"], LAYER["d_ff"], LAYER["experts"]
    return f"""### (b) our MoE layer against DeepSpeed's `deepspeed.moe.layer.MoE`

{_header(b)}
One process, {b['threads']} threads, fp32, training mode. Both layers: d_model {d_model}, {experts}
experts, each T5's gated-gelu feed-forward with d_ff {d_ff} and no bias, top-1 routing from a
float32 linear router without bias, the same router and expert weights (ours initialised, copied
into DeepSpeed's); inputs of sequences of {LAYER['length']} tokens, normal(0, 1), requiring a
gradient. Ours: `SparseMLP` with router_type 'switch' and expert_capacity_factor =
eval_expert_capacity_factor = {CAPACITY}, or neither (dropless, our default). DeepSpeed's:
`MoE(hidden_size={d_model}, expert=<the MLP>, num_experts={experts}, ep_size=1, k=1,
capacity_factor={CAPACITY}, eval_capacity_factor={CAPACITY})`, or with `drop_tokens=False`, its
other arguments at their defaults (min_capacity 4, use_rts True: random token selection), after
`set_deepspeed_parallelism()` on a gloo process group of one process. A call: forward, then
backward of the output against a fixed random gradient plus the balancing loss each layer
returns (ours adds the z-loss), gradients set to None before. Time: the median over
{b['repeats']} calls after 2 warm-up calls, the layers alternating; "DeepSpeed / ours": the
median ratio of adjacent calls (this machine's speed drifts). Peak allocated: one more call of
each under torch.profiler(profile_memory=True): the largest sum of the bytes allocated minus
freed since the call began (activations kept for backward, workspaces, the weights'
gradients), from the profiler's allocation events, the same way for both; not the resident set.

{chr(10).join(lines)}

What differs besides speed: **DeepSpeed's capacity is over the whole batch** (ceil(factor x
tokens / experts) per expert for all the batch's tokens together, which tokens are dropped drawn
at random), **ours per sequence** (ceil(factor x k x length / experts) per expert and sequence,
later positions dropped first), so at the same factor ours drops more (the "choices dropped"
column: a sequence's tokens are fewer than a batch's, and its loads less even). **Ours is
dropless by default** (no capacity factor set: every token reaches its expert); DeepSpeed's
default drops (capacity_factor 1.0). DeepSpeed (0.19.8) places the tokens into an [experts,
capacity, d_model] buffer by index (no longer GShard's one-hot einsum) and runs its experts one
after the other, each over its full capacity of rows, routed or padding (the capacity is the
busiest expert's count with `drop_tokens=False`); ours runs the routed rows only, in one grouped
matrix multiply (torch.nn.functional.grouped_mm). "held after the call": the weights' gradients
(48 MiB) and the input's, the same for both. Dropless, the two layers compute the same function
(largest difference relative to the largest value): {'; '.join(checks)}.
"""


def report_expert_parallel(c: dict) -> str:
    rows = c["rows"]
    peer = max(rows[0]["speeds"])
    speed_rows, part_rows = [], []
    for r in rows:
        ep = int(r["ep"])
        per_rank = r["parameters"] - r["expert_parameters"] + r["expert_parameters"] // ep
        speed_rows.append([r["name"], f"{per_rank / 1e6:.1f} M", f"{max(r['speeds']):.3f}",
                           f"{min(r['steps']):.2f}-{max(r['steps']):.2f}",
                           " / ".join(f"{v:.3f}" for v in r["speeds"]),
                           " / ".join(f"{v:.2f}" for v in r["others"]),
                           f"**{max(r['speeds']) / peer:.2f}**",
                           f"{gib(r['hwm'][0])} / {gib(r['hwm'][1])}"])
        for rank, k in enumerate(r["ranks"]):
            ms = {part: f"{1e3 * k[part]:.0f}" for part in ("wall", *PARTS)}
            part_rows.append([r["name"], rank, ms["wall"], ms["forward"], ms["backward"],
                              ms["optimizer"], ms["all_reduce"], f"{k['all_reduce_mib']:.0f}",
                              ms["a2a"], f"**{100 * k['share']:.1f}%**", f"{k['calls']:.0f}",
                              f"{k['mib']:.1f}"])
    speed = markdown_table(["configuration", "parameters per rank", "steps/s",
                            "step (s) min-max", "rounds (steps/s)", "others' CPU (cores)",
                            "vs EP=1", "peak RSS rank 0 / 1 (GiB)"], speed_rows)
    parts = markdown_table(["configuration", "rank", "step (ms)", "forward", "backward",
                            "optimizer", "all-reduce (in backward and optimizer)",
                            "all-reduce MiB", "all-to-all (in forward and backward)",
                            "all-to-all share of the step", "all-to-all calls",
                            "all-to-all MiB given"], part_rows)
    ep1, ep2 = rows[0]["ranks"], rows[1]["ranks"]
    rate = sum(k["mib"] for k in ep2) / max(sum(k["a2a"] for k in ep2), 1e-9)
    saved = {part: statistics.mean(a[part] - b[part] for a, b in zip(ep1, ep2))
             for part in ("wall", "optimizer", "all_reduce")}
    a2a = statistics.mean(1e3 * k["a2a"] for k in ep2)
    rest = 1e3 * (saved["wall"] - saved["optimizer"] - saved["all_reduce"]) + a2a
    return f"""### (c) expert parallelism: EP=2 against EP=1 (2 processes)

{_header(c)}
bench_training's model and flags with 8 experts in every block (`--num-experts 8
--moe-router-type switch`; {rows[0]['parameters'] / 1e6:.1f} M parameters, of them
{rows[0]['expert_parameters'] / 1e6:.1f} M in experts): d_model 512, 8 heads x 64, d_ff 1024
gated-gelu, 4 + 4 layers, untied, vocabulary 8100 padded to 8192, encoder 256 / decoder
{rows[0]['decoder_seq_length']} tokens, micro batch 4 per rank (global 8), ZeRO 0, fp32, AdamW,
dropless; two processes under `torchrun --nproc_per_node 2`, gloo, one thread each. EP=1: every
expert on both ranks, their gradients all-reduced with the rest; EP=2
(`--expert-model-parallel-size 2`): experts 0-3 on rank 0 and 4-7 on rank 1, each token's
hidden state sent to its expert's rank and back by all-to-all (forward and backward), the
experts' gradients reduced over their expert-data-parallel group (one rank: nothing to do).
Speed as bench_training's: rank 0's logged step time, the mean over steps
{c['skip'] + 1}-{c['steps']}, {c['rounds']} rounds (all configurations, then all again), the
fastest counting.

{chr(10).join(speed)}

Where a step's time goes, per rank, the mean over the fastest round's timed steps (ms). In each
rank the worker times, through the trainer's named ranges (megatron/training/timing.py), the
whole step and, inside it, the forward, backward and optimizer step, DeepSpeed's gradient
all-reduce (allreduce_gradients) and moe.py's all-to-all (the counts' exchange, then the rows
there and back, forward and backward). A collective's time includes waiting for the other rank
to arrive. "MiB given": the rank's input to those calls (the all-reduce: the gradients it
covers).

{chr(10).join(parts)}

EP=2's step is {1e3 * saved['wall']:.0f} ms shorter than EP=1's (the ranks' mean): the
optimizer takes {1e3 * saved['optimizer']:.0f} ms less (AdamW over half the experts), the
all-reduce {1e3 * saved['all_reduce']:.0f} ms less (the experts' gradients left out of it), the
all-to-all adds {a2a:.0f} ms, and the rest of the step is {rest:.0f} ms shorter (not broken down
further; at EP=1 each rank handles the gradients of twice the expert parameters: zeroing,
DeepSpeed's bucketing for the all-reduce, the norm and clipping).

What this does and does not tell about GPUs. Both ranks share the 2 cores of one host, and gloo
moves the rows through the loopback (about {rate:.0f} MiB/s counted over the time in the calls,
waits included) between expert computations that run at CPU speed. What carries over: the
counts ({ep2[0]['calls']:.0f} all-to-all calls and about {ep2[0]['mib']:.0f} MiB per rank per
step at this batch, scaling with tokens x d_model and with the sparse layers), and what EP
saves: {(rows[0]['expert_parameters'] // 2) / 1e6:.1f} M parameters per rank fewer (with their
gradients and Adam states) and the experts' gradients out of the data-parallel all-reduce. What
does not: the share. On GPUs the compute is two to three orders of magnitude faster and the
all-to-all runs over NVLink or the network (NCCL), each with its own ratio to the compute, and
it waits for the rank of the busiest expert: the share there can be much larger than here
(across nodes) or smaller (within an NVLink node); only a GPU run measures it.
"""
