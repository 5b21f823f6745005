"""CPM-2's bilingual stage at bench scale: does growing a Chinese model's vocabulary with English
pieces, new rows from their longest old prefix (convert_checkpoint.py --extend-vocab), start
better than new rows drawn at random, and does the difference last?

Stage 1: a SentencePiece tokenizer trained on the Chinese corpora only and a tiny T5 trained on
them. Stage 2: the tokenizer extended with English pieces (train_tokenizer.py --extend), the
checkpoint converted with --extend-vocab (the prefix rule), and as the baseline the same
converted checkpoint with the new tokens' rows redrawn as the model initialises them (the
embedding and the untied head: InitMethods of megatron/model/transformer.py), the old rows
bitwise the same. Both continue on a 1:2 English:Chinese blend with the same seeds and data
order; the held-out English loss (the last wikitext2 documents, in neither training nor the
tokenizer's input) is measured at step 0 and after the continued steps, each by an
evaluation-only run (--lr 0: the weights do not move; AdamW's decoupled decay is scaled by the
learning rate too).

    python bench/bench_vocab_extension.py [--stage1-steps 1000] [--stage2-steps 400] [--nproc 1]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, TINY, WORK, check_call, corpora_dir, machine_line,  # noqa: E402
                          markdown_table, run_torchrun, write_section)

OUT = WORK / "vocab_extension"
HELD_OUT_DOCS = 12  # the last wikitext2 documents: the held-out English
ENC_LEN, MICRO, EVAL_ITERS = 128, 8, 8
VALID_RE = re.compile(r" validation loss at iteration \d+ \| lm loss: ([\d.E+-]+)")
TRAIN_RE = re.compile(r" iteration\s+(\d+)/.*\| loss: ([\d.E+-]+)")


def tool(name: str, *args: str) -> None:
    check_call([sys.executable, str(REPO / "data_tools" / name), *args])


def write_jsonl(path: Path, lines: List[str]) -> Path:
    path.write_text("".join(lines), encoding="utf-8")
    return path


def prepare_text(out: Path) -> dict:
    """zh.jsonl (both Chinese corpora), en_train.jsonl (Shakespeare and wikitext2 but its last
    HELD_OUT_DOCS documents), en_heldout.jsonl (those)."""
    corpora = corpora_dir()
    zh = [line for name in ("zh_cmrc2018_wiki.jsonl", "zh_cmrc2019_stories.jsonl")
          for line in open(corpora / name, encoding="utf-8")]
    wiki = open(corpora / "en_wikitext2.jsonl", encoding="utf-8").readlines()
    shakespeare = open(corpora / "en_shakespeare.jsonl", encoding="utf-8").readlines()
    held = wiki[-HELD_OUT_DOCS:]
    train = wiki[:-HELD_OUT_DOCS] + shakespeare
    assert not set(held) & set(train), "a held-out document is in the training text"
    return {"zh": write_jsonl(out / "zh.jsonl", zh),
            "en_train": write_jsonl(out / "en_train.jsonl", train),
            "en_heldout": write_jsonl(out / "en_heldout.jsonl", held)}


def preprocess(src: Path, tokenizer: Path, prefix: Path) -> str:
    tool("preprocess_data.py", "--input", str(src), "--output-prefix", str(prefix),
         "--tokenizer-model", str(tokenizer), "--append-eod", "--workers", "1", "--no-progress")
    return f"{prefix}_text_document"


def flags(data: List[str], tokenizer: Path, model: Path, steps: int, lr: str, split: str,
          *extra: str) -> List[str]:
    return ["--data-path", *data, "--tokenizer-model", str(tokenizer), "--model-config",
            str(model), "--micro-batch-size", str(MICRO), "--encoder-seq-length", str(ENC_LEN),
            "--lr", lr, "--lr-warmup-iters", str(min(10, steps - 1)), "--train-iters", str(steps),
            "--split", split, "--eval-interval", "0", "--eval-iters", str(EVAL_ITERS),
            "--log-interval", "50", "--num-workers", "0", "--seed", "7",
            "--data-cache-path", str(OUT / "cache"), *extra]


def heldout_loss(args, ckpt: Path, tokenizer: Path, heldout: str, model: Path,
                 name: str) -> float:
    """The held-out English loss of the checkpoint's weights: one step at --lr 0 on the held-out
    data's training split, then the final evaluation of its validation split."""
    log = OUT / f"eval_{name}.log"
    run_torchrun(flags([heldout], tokenizer, model, 1, "0", "10,90,0", "--load", str(ckpt),
                       "--finetune"), log, nproc=args.nproc)
    found = VALID_RE.findall(log.read_text())
    if not found:
        sys.exit(f"no validation loss in {log}")
    return float(found[-1])


def last_train_loss(log: Path) -> str:
    found = TRAIN_RE.findall(log.read_text())
    return f"{float(found[-1][1]):.3f} at step {found[-1][0]}" if found else "not logged"


def randomised(src: Path, dst: Path, old_tok: Path, new_tok: Path,
               names=("shared.weight", "lm_head.weight")) -> int:
    """`src` (the --extend-vocab conversion) with the new tokens' rows of `names` (the embedding,
    the untied head) drawn as the model initialises them; the other tensors and rows bitwise
    kept. Returns the rows redrawn."""
    import torch

    from megatron.checkpoint.formats.weights import (WeightsReader, full_tensors,
                                                     write_weights_checkpoint)
    from megatron.checkpoint.layout import iteration_folder_name
    from megatron.data.tokenizers.extend import row_sources
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.model.config import T5Config
    from megatron.model.transformer import InitMethods

    iteration = int((src / "latest_checkpointed_iteration.txt").read_text())
    folder = src / iteration_folder_name(iteration)
    meta = json.loads((folder / "meta.json").read_text())
    plan = row_sources(T5Tokenizer(str(old_tok)), T5Tokenizer(str(new_tok)))
    fresh = torch.tensor([kind != "old" for kind in plan.kind])
    config = T5Config.from_dict(meta["model"]["config"])
    init = InitMethods(config, config.num_layers)
    torch.manual_seed(1234)
    tensors = {}
    for name, tensor in full_tensors(WeightsReader(folder)):
        if name in names:
            tensor = tensor.clone()
            rows = torch.empty(int(fresh.sum()), tensor.shape[1], dtype=torch.float32)
            init("embedding" if name == "shared.weight" else "lm_head")(rows)
            tensor[:len(fresh)][fresh] = rows.to(tensor.dtype)
        tensors[name] = tensor
    write_weights_checkpoint(dst, tensors.items(), meta["model"], iteration=iteration,
                             source={**meta["source"], "new_rows": "random (bench)"}, force=True)
    # the old rows and every other tensor bitwise the --extend-vocab conversion's
    back = dict(full_tensors(WeightsReader(dst / iteration_folder_name(iteration))))
    for name, tensor in full_tensors(WeightsReader(folder)):
        keep = ~fresh if name in names else slice(None)
        if not torch.equal(back[name][keep], tensor[keep]):
            sys.exit(f"{dst}: {name} differs from {src} beyond the new rows")
    return int(fresh.sum())


def reading(losses, steps: int) -> str:
    """The paragraph under the table, from the (step 0, step N) losses of the three arms."""
    (p0, pn), (r0, rn), (h0, hn) = losses
    head = (p0 - h0) / (p0 - r0) if abs(p0 - r0) > 1e-9 else float("nan")
    spread = max(pn, rn, hn) - min(pn, rn, hn)
    return (
        f"At step 0 the prefix rule's held-out English loss is {abs(p0 - r0):.3f} "
        f"{'above' if p0 > r0 else 'below'} that of random new rows; redrawing only the untied "
        f"head's new rows gives {h0:.3f}, so the head's rows account for {head:.0%} of that "
        f"difference and the embedding's for the rest. "
        + (f"A likely reason: a copied head row gives a new token its prefix's logit, so a "
           f"prefix and its extensions share the prefix's probability, where a small random "
           f"row leaves the new tokens near zero (CPM-2 ties the head to the embedding, where "
           f"the two cannot be separated). " if p0 > r0 and head > 0.5 else "")
        + f"After {steps} steps on "
        f"the blend the three are within {spread:.3f} of each other: at this scale, one seed "
        f"and one run each, the start of the new rows no longer shows. A tiny model (1+1 "
        f"layers, d_model {TINY['d_model']}) on a few MB of text: what it says about CPM-2's "
        f"scale is at most the direction.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage1-steps", type=int, default=1000)
    p.add_argument("--stage2-steps", type=int, default=400)
    p.add_argument("--zh-vocab", type=int, default=4000)
    p.add_argument("--add-pieces", type=int, default=1000)
    p.add_argument("--nproc", type=int, default=1, choices=(1, 2))
    p.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    text = prepare_text(OUT)
    zh_tok, ext_tok = OUT / "spm_zh.model", OUT / "spm_zh_en.model"
    tool("train_tokenizer.py", "--input", str(text["zh"]), "--output-prefix",
         str(OUT / "spm_zh"), "--vocab-size", str(args.zh_vocab), "--character-coverage", "0.995",
         "--num-threads", "1")
    tool("train_tokenizer.py", "--extend", str(zh_tok), "--input", str(text["en_train"]),
         "--add-pieces", str(args.add_pieces), "--output-prefix", str(OUT / "spm_zh_en"),
         "--character-coverage", "1.0", "--num-threads", "1")
    zh1 = preprocess(text["zh"], zh_tok, OUT / "zh_old")
    zh2 = preprocess(text["zh"], ext_tok, OUT / "zh_new")
    en2 = preprocess(text["en_train"], ext_tok, OUT / "en_new")
    held = preprocess(text["en_heldout"], ext_tok, OUT / "en_heldout")
    from megatron.data.tokenizers.tokenizer import T5Tokenizer

    old_size, new_size = T5Tokenizer(str(zh_tok)).vocab_size, T5Tokenizer(str(ext_tok)).vocab_size
    model = OUT / "tiny_zh.json"
    model.write_text(json.dumps(dict(TINY, vocab_size=old_size), indent=1) + "\n")

    stage1 = OUT / "stage1"
    run_torchrun(flags([zh1], zh_tok, model, args.stage1_steps, "3e-3", "1000,0,0",
                            "--save", str(stage1)), OUT / "stage1.log", nproc=args.nproc)
    prefix_ckpt, random_ckpt = OUT / "prefix", OUT / "random"
    from data_tools import convert_checkpoint

    if convert_checkpoint.main(["--load", str(stage1), "--to", "megatron", str(prefix_ckpt),
                                "--extend-vocab", str(ext_tok), "--no-progress"]) != 0:
        sys.exit("convert_checkpoint.py --extend-vocab failed")
    redrawn = randomised(prefix_ckpt, random_ckpt, zh_tok, ext_tok)
    head_ckpt = OUT / "prefix_embedding_random_head"
    randomised(prefix_ckpt, head_ckpt, zh_tok, ext_tok, names=("lm_head.weight",))
    new_model = prefix_ckpt / "model_config.json"
    rows, losses = [], []
    for name, ckpt in (("prefix rule (--extend-vocab)", prefix_ckpt),
                       ("random new rows", random_ckpt),
                       ("prefix rule for the embedding, random head rows", head_ckpt)):
        tag = ckpt.name
        before = heldout_loss(args, ckpt, ext_tok, held, new_model, f"{tag}_0")
        after_ckpt = OUT / f"{tag}_stage2"
        run_torchrun(flags(["1", en2, "2", zh2], ext_tok, new_model, args.stage2_steps,
                                "3e-3", "1000,0,0", "--load", str(ckpt), "--finetune",
                                "--save", str(after_ckpt)), OUT / f"{tag}_stage2.log",
                          nproc=args.nproc)
        after = heldout_loss(args, after_ckpt, ext_tok, held, new_model, f"{tag}_n")
        losses.append((before, after))
        rows.append([name, f"{before:.3f}", f"{after:.3f}",
                     last_train_loss(OUT / f"{tag}_stage2.log")])
        print(f"{name}: held-out English loss {before:.4f} at step 0, {after:.4f} after "
              f"{args.stage2_steps} steps", flush=True)
    minutes = (time.perf_counter() - start) / 60
    cmd = "python bench/bench_vocab_extension.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "no_write")
    body = [
        "## Vocabulary extension (CPM-2's bilingual stage): new rows from their prefix vs random",
        "",
        f"`{cmd}` ({minutes:.1f} min; {machine_line()}; {args.nproc} rank(s), CPU, fp32).",
        "",
        f"Stage 1: the tiny T5 (d_model {TINY['d_model']}, 1+1 layers, untied head) with a "
        f"{old_size}-id SentencePiece tokenizer trained on the Chinese corpora only, "
        f"{args.stage1_steps} steps on them (lr 3e-3, micro batch {MICRO}, {ENC_LEN} encoder "
        f"tokens; training loss {last_train_loss(OUT / 'stage1.log')}). Stage 2: the "
        f"tokenizer extended "
        f"with {args.add_pieces} English pieces (`train_tokenizer.py --extend`) to {new_size} "
        f"ids; `convert_checkpoint.py --extend-vocab` (new rows from the longest old-token "
        f"prefix, else a seeded random old token) against the same checkpoint with its "
        f"{redrawn} new rows redrawn as the model initialises them (embedding normal(1), head "
        f"truncated normal d_model^-0.5; the old rows bitwise kept); and, to tell the two "
        f"tensors apart, the prefix rule for the embedding with "
        f"the head's new rows redrawn. Each then {args.stage2_steps}"
        f" steps (--finetune: fresh Adam, same seeds and data order) on a 1:2 English:Chinese "
        f"blend. Held-out English: the last {HELD_OUT_DOCS} wikitext2 documents (not in the "
        f"training text nor in the tokenizer's input), span-corruption loss over {EVAL_ITERS} "
        f"batches of {MICRO}, by an evaluation-only run (--lr 0).",
        "",
        *markdown_table(["new rows", "held-out English loss, step 0",
                         f"after {args.stage2_steps} steps",
                         "blend training loss, last logged"], rows),
    ]
    body += ["", reading(losses, args.stage2_steps)]
    print("\n".join(body))
    if not args.no_write:
        write_section("vocab_extension", "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
