"""lm-evaluation-harness speed: `megatron.evaluate`'s model (megatron/evaluation/harness_lm.py
MegatronT5LM, built by `megatron.evaluate.load_lm`) against the harness's own hf backend
(`HFLM(backend="seq2seq")`) on our `--to hf` export of the same checkpoint, both run by
`lm_eval.simple_evaluate` in this process (issue 47 item 5).

    python bench/bench_evaluate.py [--batch-size 8] [--repeats 3] [--mc-docs 64]
        [--gen-docs 16] [--no-write] [--hf-only]

Model: T5 v1.0 small's shape (d_model 512, 8 heads x 64, d_ff 2048 ReLU, 6 + 6 layers, tied
head: the hf backend ties the head of an untied export, notes in docs/evaluation.md), the
vocabulary of bench/common.py's 8000-piece SentencePiece model + 100 sentinels, random weights
(seed 0; the pad's embedding row zeroed, else the model repeats its decoder start, the pad, and
every text is empty), fp32, evaluation mode, one process, `torch.set_num_threads(1)`. Both
load it from disk before the timing (ours: the weights checkpoint; hf: the export).

Tasks, written under bench/work/evaluate/ from the English corpora: a multiple-choice task
(--mc-docs passages of 100 to 700 characters, 4 choices of 1 to 6 words each: loglikelihood
requests) and a generate_until task (--gen-docs passages, `max_gen_toks` 32 and a stop string
that never occurs, so each generation runs to the hf backend's limit, the batch's padded
context length + 31 tokens, or to EOS).

Timed: the whole `simple_evaluate` call of one task (the harness's own work included, the same
for both), median of --repeats after one warm-up of each, ours and hf alternating.
Loglikelihood requests/s = requests / time; generate_until tokens/s = generated tokens / time,
counted in the hf backend's generate calls (each row's new tokens to EOS or to its limit; ours
generates the same, as its identical texts show).
The bench checks that the loglikelihoods agree (1e-3 relative) and the generations are
identical. Results go to bench/RESULTS.md (section evaluate) only when both sides ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (WORK, busy_seconds, english_texts, machine_line,  # noqa: E402
                          markdown_table, own_seconds, tokenizer_model, write_section)

MODEL = dict(vocab_size=8100, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
             num_decoder_layers=6, num_heads=8, feed_forward_proj="relu",
             tie_word_embeddings=True, dropout_rate=0.0)
MAX_GEN_TOKS = 32
NEVER = "<<never>>"


def write_model(root: Path, spm: Path):
    """(our weights checkpoint, its `--to hf` export) of a random MODEL, written once."""
    from data_tools import convert_checkpoint
    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import gather_full_state_dict

    ckpt, export = root / "ckpt", root / "hf"
    if not (export / "config.json").exists():
        torch.manual_seed(0)
        model = T5Model(T5Config(**MODEL)).eval()
        with torch.no_grad():  # (else a random tied T5 repeats its decoder start, the pad,
            model.shared.weight[0] = 0  # and every generated text is empty)
        if ckpt.exists():
            import shutil

            shutil.rmtree(ckpt)
        write_weights_checkpoint(ckpt, gather_full_state_dict(model).items(),
                                 {"config": T5Config(**MODEL).to_dict(),
                                  "make_vocab_size_divisible_by": 128})
        rc = convert_checkpoint.main(["--load", str(ckpt), "--to", "hf", str(export),
                                      "--tokenizer-model", str(spm), "--no-progress"])
        if rc != 0:
            sys.exit(f"convert_checkpoint --to hf exited {rc}")
    return ckpt, export


def passages(rng: random.Random, count: int, low: int, high: int):
    """`count` passages of the English corpora, each low..high characters, cut at a space."""
    texts = [t for t in english_texts() if len(t) > high * 2]
    out = []
    for _ in range(count):
        text = rng.choice(texts)
        start = rng.randrange(len(text) - high)
        size = rng.randint(low, high)
        piece = " ".join(text[start:start + size].split()[1:-1])
        out.append(piece)
    return out


def write_tasks(folder: Path, mc_docs: int, gen_docs: int) -> None:
    """bench_mc (multiple choice) and bench_gen (generate_until) under `folder`: JSONL files and
    YAMLs naming them by absolute path."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = " ".join(english_texts()[:20]).split()
    mc = [{"context": c, "choices": [" ".join(rng.sample(words, rng.randint(1, 6)))
                                     for _ in range(4)], "label": 0}
          for c in passages(rng, mc_docs, 100, 700)]
    gen = [{"context": c, "answer": "x"} for c in passages(rng, gen_docs, 100, 500)]
    for name, rows in (("mc", mc), ("gen", gen)):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n", encoding="utf-8")
    (folder / "bench_gen.yaml").write_text(
        f"task: bench_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'gen.jsonl'}\noutput_type: generate_until\ntest_split: test\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_target: answer\ngeneration_kwargs:\n"
        f"  until: [\"{NEVER}\"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n", encoding="utf-8")


def evaluate(lm, task: str, task_manager):
    """(seconds, process CPU seconds, per-request responses) of simple_evaluate on one task."""
    import lm_eval

    start, cpu = time.perf_counter(), time.process_time()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager,
                                  log_samples=True, bootstrap_iters=0)
    wall, used = time.perf_counter() - start, time.process_time() - cpu
    responses = [resp[0] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])
                 for resp in s["resps"]]
    return wall, used, responses


def counting_hflm(**kwargs):
    """The hf backend, counting the tokens its generate calls produce (each row's new tokens
    up to its EOS, or all of them) in `.generated`."""
    from lm_eval.models.huggingface import HFLM

    class CountingHFLM(HFLM):
        generated = 0

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
            eos = self.tokenizer.eos_token_id
            for row in out[:, 1:].tolist():  # (the decoder start first)
                self.generated += row.index(eos) + 1 if eos in row else len(row)
            return out

    return CountingHFLM(**kwargs)


def build_lms(args, ckpt: Path, export: Path, spm: Path):
    lms = {"hf": counting_hflm(pretrained=str(export), backend="seq2seq", device="cpu",
                               dtype="float32", batch_size=args.batch_size)}
    if not args.hf_only:
        try:
            from megatron.evaluate import load_lm
        except ImportError as err:
            print(f"ours: not measured ({err}); the hf backend alone", flush=True)
        else:
            lms["ours"] = load_lm(str(ckpt), tokenizer_model=str(spm),
                                  batch_size=args.batch_size)
    return lms


def check_same(task: str, responses) -> str:
    """'yes' when ours and hf agree (loglikelihoods to 1e-3 relative, texts exactly)."""
    if set(responses) != {"hf", "ours"}:
        return ""
    for a, b in zip(responses["ours"], responses["hf"]):
        if isinstance(a, str):
            same = a == b
        else:
            same = abs(a[0] - b[0]) <= 1e-3 * max(1.0, abs(b[0])) and a[1] == b[1]
        if not same:
            sys.exit(f"{task}: ours {a!r} and hf {b!r} differ")
    return "yes"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mc-docs", type=int, default=64)
    p.add_argument("--gen-docs", type=int, default=16)
    p.add_argument("--hf-only", action="store_true", help="measure the hf backend alone")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    root = WORK / "evaluate"
    spm = tokenizer_model(8000)
    ckpt, export = write_model(root / "model", spm)
    write_tasks(root / "tasks", args.mc_docs, args.gen_docs)
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(root / "tasks"))
    lms = build_lms(args, ckpt, export, spm)
    rows = []
    for task, unit in (("bench_mc", "requests/s"), ("bench_gen", "tokens/s")):
        lms["hf"].generated = 0
        responses = {k: evaluate(lm, task, task_manager)[2] for k, lm in lms.items()}  # warm-up
        work = len(responses["hf"]) if task == "bench_mc" else lms["hf"].generated
        same = check_same(task, responses)
        times = {k: [] for k in lms}
        cpu = {k: [] for k in lms}
        busy, own, t0 = busy_seconds(), own_seconds(), time.perf_counter()
        for _ in range(args.repeats):
            for k, lm in lms.items():
                wall, used, _ = evaluate(lm, task, task_manager)
                times[k].append(wall)
                cpu[k].append(used)
        others = max(0.0, (busy_seconds() - busy) - (own_seconds() - own)) / \
            (time.perf_counter() - t0)
        rate = {k: work / statistics.median(v) for k, v in times.items()}
        line = f"{task}: {work} {'requests' if task == 'bench_mc' else 'tokens'}; " + ", ".join(
            f"{k} {rate[k]:.1f} {unit} (runs {['%.2f' % t for t in times[k]]})" for k in lms)
        if "ours" in lms:
            ratio = rate["ours"] / rate["hf"]
            cpu_ratio = statistics.median(cpu["hf"]) / statistics.median(cpu["ours"])
            line += f"; ours / hf {ratio:.2f}x (by CPU time {cpu_ratio:.2f}x)"
            rows.append((task, unit, work, f"{rate['ours']:.1f}", f"{rate['hf']:.1f}",
                         f"{ratio:.2f}x", f"{cpu_ratio:.2f}x", f"{others:.1f}", same))
        print(line + f"; other processes {others:.1f} cores", flush=True)
    if "ours" not in lms:
        print("ours not measured: nothing written to bench/RESULTS.md")
        return
    minutes = (time.perf_counter() - started) / 60
    command = "python bench/bench_evaluate.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("no_write", "hf_only") and v != p.get_default(k))
    import lm_eval
    import transformers

    body = [
        f"Command: `{command}` ({minutes:.1f} min, {time.strftime('%Y-%m-%d')}); "
        f"{machine_line()}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lm_eval {lm_eval.__version__}.", "",
        f"`python -m megatron.evaluate`'s model (`megatron.evaluate.load_lm`, our weights "
        f"checkpoint) against lm_eval's hf backend (`HFLM(backend=\"seq2seq\")`) on its "
        f"`--to hf` export: T5 v1.0 small's shape (512 x 6 + 6 layers, d_ff 2048, tied), "
        f"vocabulary 8100, random weights, fp32, one process, `torch.set_num_threads(1)`, "
        f"batch size {args.batch_size}. Each figure: the whole `lm_eval.simple_evaluate` call "
        f"of one task, median of {args.repeats} after a warm-up, the two alternating. "
        f"bench_mc: {args.mc_docs} passages of 100-700 characters x 4 choices; bench_gen: "
        f"{args.gen_docs} passages, max_gen_toks {MAX_GEN_TOKS} and no stop string met, so "
        f"each generation runs to the backend's limit (its batch's padded context length + "
        f"{MAX_GEN_TOKS - 1}) or EOS; tokens counted in the hf backend's generate calls.",
        "",
        *markdown_table(["task", "unit", "requests or tokens", "ours", "hf backend",
                         "ours / hf", "by CPU time", "others' load (cores)", "same outputs"],
                        rows),
        "", "'same outputs': loglikelihoods within 1e-3 relative with the same is_greedy, "
        "generations identical. 'by CPU time': hf's median process CPU time / ours. "
        "'others' load': the CPU the rest of the machine used meanwhile, in cores.",
    ]
    print("\n".join(body))
    if not args.no_write:
        write_section("evaluate", "\n".join(body))


if __name__ == "__main__":
    main()
