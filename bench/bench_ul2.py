"""UL2's mixture of denoisers (`--t5-objective ul2`) against T5 span corruption: loader samples/s
and a 2-process training run of each objective.

    python bench/bench_ul2.py [--work /tmp/t5_bench_ul2] [--samples 4096] [--batch 16]
                              [--rounds 5] [--steps 200] [--skip-training]
                              [--results bench/results_ul2.md]

Data (made once under --work, reused): a SentencePiece model as the test fixture `spm_model`
trains it (tests/conftest.py: unigram, 4000 pieces + 100 sentinels, byte fallback, ~100 KB of each
of the four corpora), and all of tests/data/corpora (English and Chinese, 6.1 MB) preprocessed with
it and `--append-eod`.

(a) Loader: each objective's dataset as `build_datasets` makes it (DataConfig objective
"span-corruption" / "ul2", encoder 512, the `ul2` preset with the default mode tokens tokenized by
this tokenizer, as the flags make them), read through a torch DataLoader with the training's batch
sampler (PretrainingSampler, one rank) and `collate_fn=collate_tensors`, num_workers 0 and 2.
Samples/s of a full pass over --samples samples (worker start-up included), best of --rounds; the
rounds interleave the objectives (order flipped every round) so that the host's drift hits both,
and each round's UL2 / span-corruption ratio is kept (median and range). Samples per CPU second
(this process and its workers) beside them: the host may be shared, and other jobs slow wall time
far more than they inflate CPU time. Goal: UL2 >= 0.8x span corruption. Also each denoiser's own
CPU cost per sample on the same windows.

(b) Training: `python -m torch.distributed.run --nproc_per_node 2 -m megatron.pretrain_t5` (gloo,
CPU, one thread per rank) for each objective with the same model, seed, LR schedule, batch and
steps; `--save` and `--log-file` in --work/runs/OBJECTIVE; then `python -m megatron.plot` draws both
loss curves on one figure. The section text goes to --results (bench/RESULTS.md is not touched).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, busy_seconds, corpora_dir, machine_line, own_seconds  # noqa: E402

CORPORA = ("en_wikitext2.jsonl", "en_shakespeare.jsonl", "zh_cmrc2018_wiki.jsonl",
           "zh_cmrc2019_stories.jsonl")
"""tests/conftest.py's order (the tokenizer's sample); the .bin holds them in name order, so the
last documents (the validation split) are Chinese stories (zh_cmrc2019_stories)."""
OBJECTIVES = ("span-corruption", "ul2")
LABELS = {"span-corruption": "span corruption", "ul2": "UL2"}
ENC_LEN = 512
MODEL = dict(vocab_size=4100, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
             num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
             dropout_rate=0.0)
"""TINY_MODEL of tests/conftest.py (the same vocabulary) widened to d_model 128."""
TRAIN = dict(micro_batch=4, global_batch=8, lr="2e-3", min_lr="2e-4", warmup=20,
             eval_interval=50, eval_iters=10, log_interval=5, seed=1234, split="98,2,0")
GOAL = 0.8


# Data ---------------------------------------------------------------------------------------
def _check(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


def prepare_data(work: Path) -> Dict[str, Path]:
    """The tokenizer and the .bin/.idx of the four corpora under `work` (reused when present)."""
    work.mkdir(parents=True, exist_ok=True)
    corpora = corpora_dir()
    model, prefix = work / "spm.model", work / "corpora"
    if not model.exists():
        sample = work / "spm_sample.jsonl"  # what the spm_model fixture trains on
        with open(sample, "w", encoding="utf-8") as f:
            for name in CORPORA:
                taken = 0
                with open(corpora / name, encoding="utf-8") as src:
                    for line in src:
                        text = json.loads(line)["text"][:20_000]
                        f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                        taken += len(text.encode("utf-8"))
                        if taken >= 100_000:
                            break
        _check([sys.executable, str(REPO / "data_tools" / "train_tokenizer.py"), "--input",
                str(sample), "--output-prefix", str(work / "spm"), "--vocab-size", "4000",
                "--model-type", "unigram", "--character-coverage", "0.9995", "--byte-fallback",
                "--num-threads", "2", "--seed", "1"])
    if not Path(f"{prefix}_text_document.idx").exists():
        _check([sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input",
                *[str(corpora / name) for name in sorted(CORPORA)], "--output-prefix", str(prefix),
                "--tokenizer-model", str(model), "--append-eod", "--workers", "2",
                "--no-progress"])
    config = work / "model.json"
    config.write_text(json.dumps(MODEL, indent=1) + "\n")
    return {"tokenizer": model, "data": Path(f"{prefix}_text_document"), "model": config}


# (a) Loader ---------------------------------------------------------------------------------
def build(paths: Dict[str, Path], objective: str, samples: int):
    """(dataset, UL2Config or None) as the flags make them for `objective`."""
    from megatron.data.datasets.builder import DataConfig, build_datasets
    from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.data.datasets.ul2 import DEFAULT_MODE_TOKENS, PRESETS, UL2Config, mode_token_ids

    tokenizer = T5Tokenizer(str(paths["tokenizer"]))
    ul2 = None
    if objective == "ul2":
        ul2 = UL2Config(PRESETS["ul2"], mode_token_ids(tokenizer, dict(DEFAULT_MODE_TOKENS)), "t5")
    config = DataConfig([str(paths["data"])], split="100,0,0",
                        data_cache_path=str(paths["data"].parent / "cache"),
                        t5=T5DatasetConfig(encoder_seq_length=ENC_LEN, seed=1234, ul2=ul2),
                        objective=objective)
    dataset = build_datasets(config, T5SpecialTokens.from_tokenizer(tokenizer),
                             (samples, 0, 0))["train"]
    return dataset, ul2


def loader_pass(dataset, batch: int, workers: int) -> Tuple[float, float]:
    """(samples per second, samples per CPU second) of one pass of a fresh DataLoader over the
    whole dataset. CPU seconds: this process's and its workers' (reaped when the exhausted
    loader shuts them down), which other jobs on the host do not inflate as they do wall time."""
    import torch

    from megatron.data.datasets.samplers import PretrainingSampler
    from megatron.training.loaders import collate_tensors

    sampler = PretrainingSampler(len(dataset), 0, batch, 0, 1, drop_last=True)
    start, cpu = time.perf_counter(), own_seconds()
    seen = 0
    batches = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                               collate_fn=collate_tensors, num_workers=workers))
    for b in batches:
        seen += b["encoder_input_ids"].shape[0]
    del batches
    wall = time.perf_counter() - start
    return seen / wall, seen / max(own_seconds() - cpu, 1e-9)


def denoiser_costs(dataset, ul2, span, count: int, repeats: int = 3) -> List[tuple]:
    """(name, CPU µs per sample, best of `repeats`) of making a sample (the mask, the input and
    target, make_sample) from the same `count` raw UL2 windows, for each denoiser alone; and the
    raw window read alone, and the whole __getitem__ of both datasets."""
    from megatron.data.datasets.t5_dataset import make_sample
    from megatron.data.datasets.ul2 import UL2Config, denoise

    tokens = dataset.tokens
    sentinels = np.asarray(tokens.sentinel_ids, dtype=np.int64)
    raws = [dataset.raw_tokens(i) for i in range(count)]

    def best(fn) -> float:  # CPU time of this process: other jobs on the host inflate it less
        times = []
        for _ in range(repeats):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return min(times) / count * 1e6

    def read():
        for i in range(count):
            dataset.raw_tokens(i)

    def one_denoiser(config):
        def run():
            for i, raw in enumerate(raws):
                _, inputs, targets = denoise(raw, config, sentinels, tokens.eos_id,
                                             np.random.default_rng([1234, i]))
                make_sample(inputs, targets, dataset.encoder_length, dataset.decoder_length,
                            tokens.pad_id, tokens.decoder_start_token_id)
        return run

    def whole(ds):
        def run():
            for i in range(count):
                ds[i]
        return run

    rows = [(f"read the raw window (UL2, {dataset.raw_length} tokens)", best(read))]
    for d in ul2.denoisers:
        rows.append((ul2.describe_denoiser(d),
                     best(one_denoiser(UL2Config((d,), ul2.mode_tokens, ul2.s_prefix)))))
    rows.append((f"span corruption, whole `__getitem__` ({span.raw_length}-token window read "
                 "included)", best(whole(span))))
    rows.append(("UL2 mixture, whole `__getitem__` (window read and denoiser draw included)",
                 best(whole(dataset))))
    return rows


class OthersCpu:
    """Cores that other jobs kept busy between start() and stop(): busy time in /proc/stat less
    this process's and its reaped children's (the loader workers, the training runs)."""

    def start(self) -> "OthersCpu":
        self.t, self.busy, self.own = time.perf_counter(), busy_seconds(), own_seconds()
        return self

    def stop(self) -> float:
        wall = time.perf_counter() - self.t
        return max(0.0, (busy_seconds() - self.busy) - (own_seconds() - self.own)) / wall


def expected_targets(ul2, raw: int) -> List[tuple]:
    """(kind, expected target tokens, EOS included) of each denoiser on `raw` tokens, weighted by
    its share of the mixture (R and X: fixed lengths; S: the mean of its uniform prefix)."""
    from megatron.data.datasets.ul2 import _spans

    out = []
    for d, w in zip(ul2.denoisers, ul2.weights):
        if d.kind == "S":
            low = ul2.min_prefix(raw, d)
            n = raw - (low + raw - 1) / 2 + 1
        else:
            noise, spans = _spans(raw, d)
            n = noise + spans + 1
        out.append((d.kind, float(n) * float(w) * len(ul2.denoisers)))
    return out


def bench_loader(paths: Dict[str, Path], samples: int, batch: int, rounds: int) -> dict:
    datasets = {obj: build(paths, obj, samples) for obj in OBJECTIVES}
    best: Dict[tuple, float] = {}
    best_cpu: Dict[tuple, float] = {}
    ratios: Dict[int, List[float]] = {0: [], 2: []}
    others = OthersCpu().start()
    for r in range(rounds):
        for workers in (0, 2):
            order = OBJECTIVES if r % 2 == 0 else OBJECTIVES[::-1]
            rates = {}
            for obj in order:
                rate, per_cpu = loader_pass(datasets[obj][0], batch, workers)
                rates[obj] = rate
                best[obj, workers] = max(best.get((obj, workers), 0.0), rate)
                best_cpu[obj, workers] = max(best_cpu.get((obj, workers), 0.0), per_cpu)
                print(f"  round {r + 1} workers {workers} {obj}: {rate:,.0f} samples/s, "
                      f"{per_cpu:,.0f} samples per CPU second", flush=True)
            ratios[workers].append(rates["ul2"] / rates["span-corruption"])
    others_cpu = others.stop()
    ul2_ds, ul2 = datasets["ul2"]
    span_ds = datasets["span-corruption"][0]
    return {"best": best, "best_cpu": best_cpu, "ratios": ratios, "others_cpu": others_cpu,
            "lengths": {obj: datasets[obj][0].config.lengths() for obj in OBJECTIVES},
            "budget": ul2.describe_budget(ENC_LEN),
            "modes": {k: list(v) for k, v in ul2.mode_tokens},
            "targets": expected_targets(ul2, ul2_ds.raw_length),
            "costs": denoiser_costs(ul2_ds, ul2, span_ds, min(2000, samples))}


# (b) Training -------------------------------------------------------------------------------
def warmup(steps: int) -> int:
    """TRAIN's warm-up, shortened for a short run (it must stay below the decay steps)."""
    return max(1, min(TRAIN["warmup"], steps // 10))


def train_flags(paths: Dict[str, Path], objective: str, steps: int, out: Path) -> List[str]:
    t = TRAIN
    return ["--data-path", str(paths["data"]), "--tokenizer-model", str(paths["tokenizer"]),
            "--model-config", str(paths["model"]), "--t5-objective", objective,
            "--encoder-seq-length", str(ENC_LEN), "--micro-batch-size", str(t["micro_batch"]),
            "--global-batch-size", str(t["global_batch"]), "--lr", t["lr"], "--min-lr",
            t["min_lr"], "--lr-decay-style", "cosine", "--lr-warmup-iters", str(warmup(steps)),
            "--train-iters", str(steps), "--split", t["split"], "--eval-interval",
            str(t["eval_interval"]), "--eval-iters", str(t["eval_iters"]), "--log-interval",
            str(t["log_interval"]), "--seed", str(t["seed"]), "--num-workers", "0",
            "--data-cache-path", str(paths["data"].parent / "cache"), "--save", str(out),
            "--log-file", str(out / "log.txt"), "--no-plots"]


def launch_command(flags: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(29500 + os.getpid() % 1000), "-m", "megatron.pretrain_t5",
            *flags]


def train(paths: Dict[str, Path], objective: str, steps: int, runs: Path) -> dict:
    from megatron.plot.find import load_run

    out = runs / objective
    shutil.rmtree(out, ignore_errors=True)  # --log-file appends: start from nothing
    out.mkdir(parents=True)
    start, others = time.perf_counter(), OthersCpu().start()
    with open(out / "stdout.txt", "w") as f:
        proc = subprocess.run(launch_command(train_flags(paths, objective, steps, out)),
                              cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall, others_cpu = time.perf_counter() - start, others.stop()
    if proc.returncode != 0:
        lines = (out / "stdout.txt").read_text().splitlines()
        tail = [x for x in lines if x.lstrip().startswith(("error", "-", "Error"))][:20] + \
            lines[-10:]
        sys.exit(f"training {objective} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    run = load_run(str(out), LABELS[objective], "log")
    its, loss = run.series("loss")
    _, step_s = run.series("step_time_s")
    valid = sorted(run.evals.get("valid", {}).items())
    last_n = max(1, 50 // TRAIN["log_interval"])
    return {"dir": str(out), "wall_s": wall, "others_cpu": others_cpu,
            "iterations": its[-1] if its else 0,
            "loss_first": loss[0], "loss_last": loss[-1],
            "loss_last50": float(np.mean(loss[-last_n:])),
            "valid": valid, "step_s": float(np.mean(step_s[1:])) if len(step_s) > 1 else 0.0}


def plot(runs: Path, out: Path) -> str:
    cmd = [sys.executable, "-m", "megatron.plot", *[str(runs / o) for o in OBJECTIVES],
           "--labels", *[LABELS[o] for o in OBJECTIVES], "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    found = re.search(r"wrote (\S*loss\.png)", proc.stdout)
    return found.group(1) if found else ""


# Report -------------------------------------------------------------------------------------
def report(args, paths, loader, training, png, minutes, code) -> str:
    import torch

    from megatron.data.storage.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(paths["data"]))
    best = loader["best"]
    (raw_s, _, dec_s), (raw_u, _, dec_u) = (loader["lengths"][o] for o in OBJECTIVES)
    rows, verdicts, cpu_ratios = [], [], []
    for workers in (0, 2):
        s, u = best["span-corruption", workers], best["ul2", workers]
        ratio, paired = u / s, loader["ratios"][workers]
        sc, uc = loader["best_cpu"]["span-corruption", workers], loader["best_cpu"]["ul2", workers]
        rows.append(f"| {workers} | {s:,.0f} | {u:,.0f} | **{ratio:.2f}x** | "
                    f"{np.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f}) | "
                    f"{sc:,.0f} | {uc:,.0f} | {uc / sc:.2f}x |")
        cpu_ratios.append(uc / sc)
        verdicts.append(f"{ratio:.2f}x with {workers} workers")
    met = all(best["ul2", w] / best["span-corruption", w] >= GOAL for w in (0, 2))
    paired_met = all(np.median(loader["ratios"][w]) >= GOAL for w in (0, 2))
    slower = [LABELS[o] for o in OBJECTIVES if best[o, 2] < best[o, 0]]
    workers_note = ""
    if slower:
        workers_note = (f" With 2 workers {' and '.join(slower)} "
                        f"{'is' if len(slower) == 1 else 'are'} slower than with none on this "
                        f"{os.cpu_count()}-core host: the main process and the workers share the "
                        "cores, and every batch crosses from a worker through shared memory "
                        f"(UL2's batches are the larger: decoder {dec_u} tokens against {dec_s}).")
    cost_rows = "\n".join(f"| {name} | {us:,.0f} |" for name, us in loader["costs"])
    modes = ", ".join(f"{k} {len(v)}" for k, v in loader["modes"].items())
    work = args.work
    cmd = (f"python bench/bench_ul2.py --work {work} --samples {args.samples} "
           f"--batch {args.batch} --rounds {args.rounds} --steps {args.steps}")
    body = f"""## UL2

Command: `{cmd}` ({minutes:.1f} min in all)
Machine: {machine_line()}, torch {torch.__version__}. Code: {code}. Data: the four corpora of tests/data/corpora
(English and Chinese, 6.1 MB) preprocessed with `--append-eod` ({ds.num_tokens / 1e6:.2f} M
tokens, {ds.num_documents} documents) by a SentencePiece model trained as the test fixture
`spm_model` trains it (unigram, 4000 pieces + 100 sentinels, byte fallback), all under `{work}`.

### Loader samples/s

Each objective's training dataset as `build_datasets` makes it for `--t5-objective
span-corruption` and `--t5-objective ul2` (the `ul2` preset: the paper's seven denoisers, equal
weights; mode tokens `[NLU]`/`[NLG]`/`[S2S]` as the flags make them, here {modes} pieces long),
encoder {ENC_LEN} tokens: span corruption {raw_s} raw tokens -> {ENC_LEN} / {dec_s}, UL2 {raw_u} raw
tokens -> {ENC_LEN} / {dec_u} (the decoder holds the S denoiser's longest target). A torch
`DataLoader` with the training's batch sampler (`PretrainingSampler`, micro batch {args.batch}, one
rank) and `collate_fn=collate_tensors` reads {args.samples} samples; a fresh loader per pass
(worker start-up included), best of {args.rounds} rounds. The rounds interleave the objectives
(order flipped every round); "paired rounds" is the median (range) of each round's UL2 pass over
the span-corruption pass beside it, which the host's drift moves less than the ratio of bests.
Other jobs kept {loader['others_cpu']:.2f} of the {os.cpu_count()} cores busy meanwhile (busy
time in /proc/stat less this bench's own, its loader workers included), which slows wall time;
the last three columns count samples per CPU second of this process and its loader workers
(best of the rounds), which other jobs inflate much less.

| num_workers | span corruption (samples/s) | UL2 (samples/s) | UL2 / span corruption | paired rounds, median (range) | span corruption (samples per CPU s) | UL2 (samples per CPU s) | UL2 / span corruption, CPU |
| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

Goal UL2 >= {GOAL}x span corruption's samples/s: **{'met' if met else 'not met'}** on the ratio
of bests ({', '.join(verdicts)}); on the paired medians: {'met' if paired_met else 'not met'};
per CPU second: {'met' if min(cpu_ratios) >= GOAL else 'not met'}
({', '.join(f'{r:.2f}x' for r in cpu_ratios)}).{workers_note}

CPU time of one sample in one process, µs, best of 3 (each denoiser alone on the same
{min(2000, args.samples)} UL2 windows: its generator, mask, input and target, fixed-shape arrays):

| step | µs per sample |
| --- | ---: |
{cost_rows}
"""
    if training:
        t = TRAIN
        lines = []
        for obj in OBJECTIVES:
            r = training[obj]
            final_valid = r["valid"][-1] if r["valid"] else (0, float("nan"))
            lines.append(f"| {LABELS[obj]} | {r['iterations']} | {r['loss_first']:.3f} | "
                         f"{r['loss_last']:.3f} | {r['loss_last50']:.3f} | "
                         f"{final_valid[1]:.3f} (step {final_valid[0]}) | {r['step_s']:.2f} | "
                         f"{r['wall_s']:.0f} | {r['others_cpu']:.2f} |")
        targets = loader["targets"]
        hard = sum(n for kind, n in targets if kind in "SX") / sum(n for _, n in targets)
        mean_target = sum(n for _, n in targets) / len(targets)
        flags = " ".join(train_flags(paths, "OBJECTIVE", args.steps,
                                     Path(work) / "runs" / "OBJECTIVE"))
        flags = flags.replace(str(work), "$WORK")
        body += f"""
### Training, each objective

Command (OBJECTIVE = `span-corruption`, then `ul2`; WORK = `{work}`):
`python -m torch.distributed.run --nproc_per_node 2 -m megatron.pretrain_t5 {flags}`

Two processes, gloo on CPU, one thread each. Model: TINY_MODEL of tests/conftest.py widened to
d_model {MODEL['d_model']}, {MODEL['num_heads']} heads x {MODEL['d_kv']}, d_ff {MODEL['d_ff']}
gated-gelu, {MODEL['num_layers']} + {MODEL['num_decoder_layers']} layers, untied, vocabulary
{MODEL['vocab_size']}; encoder {ENC_LEN} tokens, micro batch {t['micro_batch']} per rank (global
{t['global_batch']}), {args.steps} steps, AdamW, LR {t['lr']} (warm-up {warmup(args.steps)} steps, cosine
to {t['min_lr']}), seed {t['seed']}, dropout 0; validation every {t['eval_interval']} steps on
{t['eval_iters']} batches of the 2% validation split, each run on its own objective's samples.
Train loss: token-weighted mean over each logged interval of {t['log_interval']} steps.

| objective | steps | first logged train loss | final train loss | mean of the last 50 steps | final validation loss | s/step | wall (s) | others' CPU (cores) |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(lines)}

The two objectives' losses are **not directly comparable**: each run is scored on its own
objective's targets. Span corruption predicts 15% of the window, in spans of 3 tokens behind
sentinels, from context on both sides ({dec_s} target tokens a sample). UL2 adds prefix-LM (S:
the whole rest of the window after a random prefix, left context only) and extreme denoising (X:
up to half of the window, spans up to 64 tokens), which are harder per token, and they hold
{hard:.0%} of UL2's target tokens (expected {mean_target:.0f} a sample over the mixture), so they
dominate its token-weighted train and validation losses. Which run's loss is lower says nothing
about which model is better; that needs a common evaluation of both checkpoints (the same
held-out task). Both runs share the seed, LR schedule, batch and steps; their windows differ
({raw_s} against {raw_u} raw tokens) and so do their targets. UL2's steps took
{training['ul2']['step_s'] / training['span-corruption']['step_s']:.2f}x span corruption's at the
same batch: its decoder is {dec_u} tokens long against {dec_s} (s/step: rank 0's logged step time,
mean over the logged intervals after the first). Other jobs on the host kept the cores of the
last column busy during each run, which slows both and makes that ratio indicative only; the
losses do not depend on it (the same flags give the same losses at any speed). The validation
split is the last 2% of the documents, all Chinese stories (zh_cmrc2019_stories) in this file,
while training reads Shakespeare, English and Chinese Wikipedia and the other stories: hence
validation above train for both.

Loss curves, drawn by
`python -m megatron.plot $WORK/runs/span-corruption $WORK/runs/ul2 --labels "span corruption" UL2 --output $WORK/plots`

`{png.replace(str(work), '$WORK')}`: the raw and smoothed (0.6) train loss of both runs by step, with
their validation points. Figures are not committed in this repository, so the PNG stays there (not
under bench/): rerun the bench, or that command, to redraw it.
"""
    return body


def code_version() -> str:
    """The commit and whether megatron/ differs from it (what the figures measure)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = [line[3:] for line in git("status", "--porcelain", "megatron").splitlines() if line]
    return f"commit {commit}" + (f" with local changes to {', '.join(dirty)}" if dirty
                                 else ", megatron/ unmodified")


def reflow(text: str, width: int = 100) -> str:
    """Paragraphs filled to `width`; tables, headings, commands and code lines kept as they are
    (a paragraph starting with "Command:" keeps its first line)."""
    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if any(line.startswith(("|", "#", "<!--", "`python")) for line in lines):
            out.append(block)
            continue
        head = [lines.pop(0)] if lines[0].startswith("Command:") else []
        fill = textwrap.fill(" ".join(line.strip() for line in lines), width,
                             break_long_words=False, break_on_hyphens=False)
        out.append("\n".join(head + ([fill] if fill else [])))
    return "\n\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/t5_bench_ul2",
                   help="tokenizer, data, index caches, runs and plots (reused when present)")
    p.add_argument("--samples", type=int, default=4096, help="samples per loader pass")
    p.add_argument("--batch", type=int, default=16, help="loader micro batch")
    p.add_argument("--rounds", type=int, default=5,
                   help="loader passes of each objective and worker count (best and median)")
    p.add_argument("--steps", type=int, default=200, help="training steps of each objective")
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the section from WORK/results.json (the last run's figures)")
    p.add_argument("--results", default=str(REPO / "bench" / "results_ul2.md"),
                   help="where the section text goes ('-': nowhere)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    begin, code = time.perf_counter(), code_version()
    work = Path(args.work)
    paths = prepare_data(work)
    saved = work / "results.json"
    if args.report_only:
        data = json.loads(saved.read_text())
        for key in ("samples", "batch", "rounds", "steps"):
            setattr(args, key, data["args"][key])
        loader = data["loader"]
        for key in ("best", "best_cpu"):  # "objective/workers" -> (objective, workers)
            loader[key] = {(k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])): v
                           for k, v in loader[key].items()}
        loader["ratios"] = {int(k): v for k, v in loader["ratios"].items()}
        training, png, minutes = data["training"], data["png"], data["minutes"]
        code = data.get("code", "not recorded")
    else:
        print("(a) loader samples/s", flush=True)
        loader = bench_loader(paths, args.samples, args.batch, args.rounds)
        print(loader["budget"])
        training, png = {}, ""
        if not args.skip_training:
            for obj in OBJECTIVES:
                print(f"(b) training {obj}, {args.steps} steps", flush=True)
                training[obj] = train(paths, obj, args.steps, work / "runs")
            png = plot(work / "runs", work / "plots")
        minutes = (time.perf_counter() - begin) / 60
        plain = dict(loader, best={f"{o}/{w}": v for (o, w), v in loader["best"].items()},
                     best_cpu={f"{o}/{w}": v for (o, w), v in loader["best_cpu"].items()})
        saved.write_text(json.dumps({"args": vars(args), "loader": plain, "training": training,
                                     "png": png, "minutes": minutes, "code": code},
                                    indent=1) + "\n")
    body = report(args, paths, loader, training, png, minutes, code)
    body = f"<!-- ul2:begin -->\n{reflow(body).rstrip()}\n<!-- ul2:end -->\n"
    if args.results != "-":
        Path(args.results).write_text(body)
    print(body)
    if args.results != "-":
        print(f"section text written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
