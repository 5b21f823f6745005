"""Score a prediction file with fine-tuning's task metrics (docs/evaluation.md).

    python -m megatron.generate --load ckpt/ --tokenizer-model spm/t5.model \
        --input valid.jsonl --input-key input --output out.jsonl [--num-beams 4]
    python data_tools/score_predictions.py --predictions out.jsonl --targets valid.jsonl \
        --metrics exact_match,rouge_l,bleu [--eval-rouge-tokenize chars] \
        [--eval-bleu-tokenize zh] [--label-words 是 否]

Line i of --predictions (its --prediction-key string, default `text`: what megatron.generate
writes) is scored against line i of --targets (its --target-key string, default `target`;
without --targets, the predictions' own file). The metrics are megatron/evaluation/
task_metrics.py's, computed as fine-tuning's validation computes them (exact_match,
label_accuracy, rouge_l, bleu; first_token_accuracy reads the model's logits, so a file cannot
give it). Prints one JSON object: each metric's number and "examples". Every problem (a flag,
a file's line, the line counts) is listed at once, exit 2.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.cli import CommandLineParser, refuse
from megatron.data.preprocess.jsonl import BadLine, read_fields
from megatron.evaluation import task_metrics


def build_parser() -> CommandLineParser:
    parser = CommandLineParser(prog="score_predictions.py", description=__doc__.split("\n")[0])
    parser.add_argument("--predictions", required=True, metavar="OUT.jsonl",
                        help="one JSON object a line, the prediction under --prediction-key")
    parser.add_argument("--prediction-key", default="text",
                        help="the predictions' key (default text: megatron.generate's output)")
    parser.add_argument("--targets", default=None, metavar="IN.jsonl",
                        help="the targets, line by line (default: --predictions itself)")
    parser.add_argument("--target-key", default="target", help="the targets' key")
    parser.add_argument("--metrics", default="exact_match", metavar="NAMES",
                        help="comma-separated: exact_match, label_accuracy, rouge_l, bleu")
    parser.add_argument("--label-words", nargs="+", default=None,
                        help="the label words of label_accuracy")
    parser.add_argument("--eval-bleu-tokenize", default=None, metavar="NAME",
                        help="sacrebleu's tokenizer for bleu (default 13a; zh for Chinese)")
    parser.add_argument("--eval-rouge-tokenize", default=None, choices=("words", "chars"),
                        help="rouge_l's tokens: words (rouge-score's default) or chars")
    return parser


def _read(path: str, key: str, flag: str, problems: List[str]) -> Optional[List[str]]:
    try:
        return [text for (text,) in read_fields(path, (key,), (flag,))]
    except BadLine as e:
        problems.append(str(e))
    except OSError as e:
        problems.append(f"{path}: cannot be read ({e.strerror or e})")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    names = task_metrics.parse_metrics(args.metrics)
    # the trainer's checks of the same choices (as flags of a fine-tuning run)
    problems = [p.replace("--finetune-metrics", "--metrics") for p in task_metrics.flag_problems({
        "finetune_data": args.predictions, "finetune_valid_data": args.predictions,
        "finetune_metrics": args.metrics, "label_words": args.label_words,
        "eval_bleu_tokenize": args.eval_bleu_tokenize,
        "eval_rouge_tokenize": args.eval_rouge_tokenize})]
    if "first_token_accuracy" in names:
        problems.append("--metrics first_token_accuracy reads the model's first decoder step: "
                        "a prediction file cannot give it (fine-tuning's validation does)")
    predictions = _read(args.predictions, args.prediction_key, "--prediction-key", problems)
    targets = _read(args.targets or args.predictions, args.target_key, "--target-key", problems)
    if predictions is not None and targets is not None:
        if len(predictions) != len(targets):
            problems.append(f"--predictions {args.predictions} has {len(predictions)} lines, "
                            f"--targets {args.targets or args.predictions} {len(targets)}: "
                            "give the file the predictions were made from")
        elif not targets:
            problems.append(f"--predictions {args.predictions}: no lines to score")
    if problems:
        refuse(problems, job=False)
    scoring = task_metrics.Scoring.of(names, args.label_words or (), args.eval_bleu_tokenize,
                                      args.eval_rouge_tokenize)
    stats = task_metrics.statistics(scoring, predictions, targets)
    print(json.dumps(task_metrics.scores(scoring, stats), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
