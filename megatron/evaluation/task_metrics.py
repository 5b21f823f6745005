"""CPM-2's task metrics over plain strings: what fine-tuning's validation reports
(`--finetune-metrics`, megatron/training/finetune_metrics.py) and what
data_tools/score_predictions.py computes on a prediction file (docs/evaluation.md).

- `exact_match`: the prediction equals the target, both stripped of surrounding whitespace
  (case and punctuation count);
- `label_accuracy` (`--label-words`): the prediction counts as the label word it equals
  (stripped) and is right when that word is the target; one equal to no label word is wrong;
- `first_token_accuracy` (`--label-words`): CPM-2's verbalizer scoring (CPM-2-Finetune's
  `evaluate` for c3, lcqmc, ccpm): no generation; of the first decoder step's logits only the
  label words' first tokens are compared, the best one's word is the prediction, right when it
  is the target (`first_token_ids`, `first_token_labels`);
- `rouge_l`: ROUGE-L F-measure of rouge-score (`RougeScorer(["rougeL"])`), averaged over
  examples; tokenized by rouge-score's default tokenizer (`words`: lowercased ASCII words; it
  drops every other character, so Chinese scores 0) or into characters (`chars`: each
  non-whitespace character a token, as CPM-2-Finetune scores LCSTS);
- `bleu`: sacrebleu's corpus BLEU (0-100) with one of its tokenizers (`13a`, its default; `zh`
  for Chinese targets, as WMT en-zh is scored).

Every metric is kept as additive statistics (`statistics`: integer sums), added over batches
and data-parallel ranks before `scores` turns them into numbers, so the numbers do not depend
on how the examples were split: counts for the accuracies, sacrebleu's n-gram match and total
counts and lengths for BLEU (the statistics its own corpus score sums), and for ROUGE-L the sum
of the per-example scores in fixed point (`ROUGE_SCALE`: each score rounded to 2**-40, integer
sums are exact in any order).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

METRICS = ("exact_match", "label_accuracy", "first_token_accuracy", "rouge_l", "bleu")
"""Every metric `--finetune-metrics` may name, in the order the log line lists them."""
GENERATED = ("exact_match", "label_accuracy", "rouge_l", "bleu")
"""The metrics that score a generated text (the others read the first step's logits)."""
NEED_LABEL_WORDS = ("label_accuracy", "first_token_accuracy")
ROUGE_TOKENIZE = ("words", "chars")
BLEU_DEFAULT_TOKENIZE = "13a"
ROUGE_SCALE = 2 ** 40
"""ROUGE-L scores are summed as integers in units of 1 / ROUGE_SCALE (exact in any order;
2**23 examples of score 1 fit in int64)."""
BLEU_ORDER = 4
LABELS = {"exact_match": "exact match", "label_accuracy": "label accuracy",
          "first_token_accuracy": "first-token accuracy", "rouge_l": "ROUGE-L", "bleu": "BLEU"}
"""How the log line names each metric."""
PACKAGES = {"rouge_l": ("rouge_score", "rouge-score"), "bleu": ("sacrebleu", "sacrebleu")}
"""metric -> (module, package) of the library that scores it (the `eval` extra)."""


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What a validation (or a prediction file) is scored by.

    metrics: names of METRICS, in METRICS order.
    label_words: `--label-words` (empty: not a label task).
    bleu_tokenize: sacrebleu's tokenizer name (`--eval-bleu-tokenize`).
    rouge_tokenize: `words` or `chars` (`--eval-rouge-tokenize`).
    num_beams: `--eval-num-beams`, the search of the generated metrics (1: greedy).
    """
    metrics: Tuple[str, ...]
    label_words: Tuple[str, ...] = ()
    bleu_tokenize: str = BLEU_DEFAULT_TOKENIZE
    rouge_tokenize: str = "words"
    num_beams: int = 1

    @property
    def generates(self) -> bool:
        """Whether a metric scores generated text (else only the first step runs)."""
        return any(m in GENERATED for m in self.metrics)

    @classmethod
    def of(cls, metrics: Sequence[str] = (), label_words: Sequence[str] = (),
           bleu_tokenize: Optional[str] = None, rouge_tokenize: Optional[str] = None,
           num_beams: int = 1) -> "Scoring":
        """From the flags' values (`metrics` empty: `default_metrics`; None: the defaults)."""
        chosen = tuple(metrics) or default_metrics(label_words)
        return cls(tuple(m for m in METRICS if m in chosen), tuple(label_words),
                   bleu_tokenize or BLEU_DEFAULT_TOKENIZE, rouge_tokenize or "words",
                   num_beams)


def default_metrics(label_words: Sequence[str]) -> Tuple[str, ...]:
    """Without --finetune-metrics: exact match, and label accuracy with --label-words."""
    return ("exact_match", "label_accuracy") if label_words else ("exact_match",)


def parse_metrics(text: Optional[str]) -> Tuple[str, ...]:
    """The names of a comma-separated --finetune-metrics value (None: none given)."""
    if text is None:
        return ()
    return tuple(name.strip() for name in text.split(",") if name.strip())


def flag_problems(flags: Mapping[str, object]) -> List[str]:
    """Every problem of --finetune-metrics, --eval-num-beams, --eval-bleu-tokenize and
    --eval-rouge-tokenize (`vars(namespace)`), one line each naming the flag."""
    get = flags.get
    text, beams = get("finetune_metrics"), get("eval_num_beams", 1)
    bleu, rouge = get("eval_bleu_tokenize"), get("eval_rouge_tokenize")
    given = [flag for flag, value in (("--finetune-metrics", text),
                                      ("--eval-bleu-tokenize", bleu),
                                      ("--eval-rouge-tokenize", rouge)) if value is not None]
    if beams != 1:
        given.append("--eval-num-beams")
    if get("finetune_data") is None:
        return [f"{flag} needs --finetune-data (it scores fine-tuning's validation)"
                for flag in given]
    problems = []
    if given and get("finetune_valid_data") is None:
        problems += [f"{flag} needs --finetune-valid-data (it scores the validation)"
                     for flag in given]
    names = parse_metrics(text)
    if text is not None and not names:
        problems.append("--finetune-metrics names no metric (choose from "
                        f"{', '.join(METRICS)})")
    for name in sorted(set(names), key=names.index):
        if name not in METRICS:
            problems.append(f"--finetune-metrics: unknown metric {name!r} (choose from "
                            f"{', '.join(METRICS)})")
        elif names.count(name) > 1:
            problems.append(f"--finetune-metrics names {name} twice")
    chosen = [n for n in names if n in METRICS] or list(default_metrics(get("label_words")))
    for name in chosen:
        if name in NEED_LABEL_WORDS and not get("label_words"):
            problems.append(f"--finetune-metrics {name} needs --label-words (the label "
                            "task's words)")
        if name in PACKAGES and not _installed(PACKAGES[name][0]):
            problems.append(f"--finetune-metrics {name} needs the {PACKAGES[name][1]} package: "
                            "pip install -e '.[eval]'")
    if beams < 1:
        problems.append(f"--eval-num-beams must be at least 1, not {beams}")
    elif beams > 1 and not any(n in GENERATED for n in chosen):
        problems.append(f"--eval-num-beams {beams}: none of the metrics ({', '.join(chosen)}) "
                        "generates text (beam search serves exact_match, label_accuracy, "
                        "rouge_l and bleu)")
    if bleu is not None:
        if "bleu" not in chosen:
            problems.append("--eval-bleu-tokenize needs bleu in --finetune-metrics")
        elif _installed("sacrebleu") and bleu not in bleu_tokenizers():
            problems.append(f"--eval-bleu-tokenize {bleu}: not one of sacrebleu's tokenizers "
                            f"({', '.join(bleu_tokenizers())})")
    if rouge is not None and "rouge_l" not in chosen:
        problems.append("--eval-rouge-tokenize needs rouge_l in --finetune-metrics")
    return problems


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def bleu_tokenizers() -> Tuple[str, ...]:
    """sacrebleu's tokenizer names (--eval-bleu-tokenize's choices)."""
    from sacrebleu.metrics import BLEU

    return tuple(BLEU.TOKENIZERS)


# The metrics of strings -----------------------------------------------------------------------
def _checked(predictions: Sequence[str], targets: Sequence[str]) -> None:
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    if not predictions:
        raise ValueError("no predictions to score")


def exact_match(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """Fraction of predictions equal to their target (surrounding whitespace ignored)."""
    _checked(predictions, targets)
    return sum(p.strip() == t.strip() for p, t in zip(predictions, targets)) / len(targets)


def as_label(prediction: str, label_words: Sequence[str]) -> Optional[str]:
    """The label word `prediction` equals (stripped), or None."""
    text = prediction.strip()
    for word in label_words:
        if text == word.strip():
            return word
    return None


def label_accuracy(predictions: Sequence[str], targets: Sequence[str],
                   label_words: Sequence[str]) -> float:
    """Fraction of predictions that are a label word and the one of their target."""
    _checked(predictions, targets)
    if not label_words:
        raise ValueError("label accuracy needs --label-words")
    return _label_right(predictions, targets, label_words) / len(targets)


def _label_right(predictions: Sequence[str], targets: Sequence[str],
                 label_words: Sequence[str]) -> int:
    right = 0
    for prediction, target in zip(predictions, targets):
        label = as_label(prediction, label_words)
        right += label is not None and label.strip() == target.strip()
    return right


def first_token_ids(label_words: Sequence[str], encode: Callable[[str], List[int]]
                    ) -> List[int]:
    """Each label word's first token id, as the run's tokenizer (`encode`, without EOS)
    tokenizes a target that is that word: the token the first decoder step must predict.

    Raises:
        ValueError: naming --label-words: a word without tokens, or two words beginning with
            the same token (first-token accuracy could not tell them apart).
    """
    ids: List[int] = []
    for word in label_words:
        tokens = encode(word)
        if not tokens:
            raise ValueError(f"--label-words: {word!r} has no tokens")
        if tokens[0] in ids:
            other = label_words[ids.index(tokens[0])]
            raise ValueError(f"--label-words: {other!r} and {word!r} begin with the same token "
                             f"(id {tokens[0]}), so first_token_accuracy cannot tell them apart;"
                             " choose label words that begin with different tokens")
        ids.append(tokens[0])
    return ids


def first_token_labels(logits, ids: Sequence[int], label_words: Sequence[str]) -> List[str]:
    """Each row's label word: the one whose first token (`ids`, first_token_ids) has the
    highest of the first decoder step's `logits` [rows, vocab] (a tie: the earlier word)."""
    import torch

    index = torch.as_tensor(list(ids), dtype=torch.long, device=logits.device)
    return [label_words[i] for i in logits.index_select(1, index).argmax(dim=1).tolist()]


class CharTokenizer:
    """rouge-score's tokenizer interface (`tokenize(text) -> tokens`): each non-whitespace
    character a token, nothing lowercased or dropped (CPM-2-Finetune's LCSTS scoring splits
    the decoded text into characters, `list(text)`)."""

    def tokenize(self, text: str) -> List[str]:
        return [c for c in text if not c.isspace()]


@functools.lru_cache(maxsize=2)
def _rouge_scorer(tokenize: str):
    from rouge_score import rouge_scorer

    if tokenize not in ROUGE_TOKENIZE:
        raise ValueError(f"--eval-rouge-tokenize {tokenize}: choose words or chars")
    return rouge_scorer.RougeScorer(["rougeL"],
                                    tokenizer=CharTokenizer() if tokenize == "chars" else None)


def rouge_l(predictions: Sequence[str], targets: Sequence[str],
            tokenize: str = "words") -> List[float]:
    """Each example's ROUGE-L F-measure (rouge-score; `tokenize`: words or chars)."""
    _checked(predictions, targets)
    scorer = _rouge_scorer(tokenize)
    return [scorer.score(t, p)["rougeL"].fmeasure for p, t in zip(predictions, targets)]


def bleu_counts(predictions: Sequence[str], targets: Sequence[str],
                tokenize: str = BLEU_DEFAULT_TOKENIZE) -> List[int]:
    """sacrebleu's corpus statistics of the pairs (one reference each): [hypotheses' length,
    references' length, matched 1..4-grams, hypotheses' 1..4-grams]; they add up over parts
    of a corpus to the whole's."""
    from sacrebleu.metrics import BLEU

    _checked(predictions, targets)
    score = BLEU(tokenize=tokenize).corpus_score(list(predictions), [list(targets)])
    return [score.sys_len, score.ref_len, *score.counts, *score.totals]


def bleu_of_counts(counts: Sequence[int]) -> float:
    """sacrebleu's corpus BLEU (0-100, its default exponential smoothing) of `bleu_counts`
    (summed over parts)."""
    from sacrebleu.metrics import BLEU

    n = BLEU_ORDER
    return BLEU.compute_bleu(correct=[int(c) for c in counts[2:2 + n]],
                             total=[int(c) for c in counts[2 + n:2 + 2 * n]],
                             sys_len=int(counts[0]), ref_len=int(counts[1]),
                             smooth_method="exp").score


# Additive statistics --------------------------------------------------------------------------
BLEU_KEYS = ("bleu_sys_len", "bleu_ref_len",
             *(f"bleu_correct_{n}" for n in range(1, BLEU_ORDER + 1)),
             *(f"bleu_total_{n}" for n in range(1, BLEU_ORDER + 1)))
COUNT_KEYS = {"exact_match": "exact", "label_accuracy": "label_right",
              "first_token_accuracy": "first_token_right", "rouge_l": "rouge_l_sum"}
"""metric -> its statistic (BLEU's are BLEU_KEYS); every statistic is an integer."""


def empty_statistics(scoring: Scoring) -> Dict[str, int]:
    """The statistics of no example (every key, 0): what a rank without examples adds."""
    out = {"examples": 0}
    for name in scoring.metrics:
        for key in BLEU_KEYS if name == "bleu" else (COUNT_KEYS[name],):
            out[key] = 0
    return out


def statistics(scoring: Scoring, predictions: Optional[Sequence[str]], targets: Sequence[str],
               first_labels: Optional[Sequence[str]] = None) -> Dict[str, int]:
    """The additive statistics of one part of a corpus. `predictions`: the generated texts
    (None when no metric generates); `first_labels`: first_token_labels' words (with
    first_token_accuracy)."""
    out = empty_statistics(scoring)
    if not targets:
        return out
    out["examples"] = len(targets)
    chosen = scoring.metrics
    if "exact_match" in chosen:
        _checked(predictions, targets)
        out["exact"] = sum(p.strip() == t.strip() for p, t in zip(predictions, targets))
    if "label_accuracy" in chosen:
        out["label_right"] = _label_right(predictions, targets, scoring.label_words)
    if "first_token_accuracy" in chosen:
        _checked(first_labels, targets)
        out["first_token_right"] = sum(w.strip() == t.strip()
                                       for w, t in zip(first_labels, targets))
    if "rouge_l" in chosen:
        out["rouge_l_sum"] = sum(round(s * ROUGE_SCALE) for s in
                                 rouge_l(predictions, targets, scoring.rouge_tokenize))
    if "bleu" in chosen:
        out.update(zip(BLEU_KEYS, bleu_counts(predictions, targets, scoring.bleu_tokenize)))
    return out


def added(a: Mapping[str, int], b: Mapping[str, int]) -> Dict[str, int]:
    """The statistics of two parts together."""
    return {k: a[k] + b[k] for k in a}


def scores(scoring: Scoring, stats: Mapping[str, float]) -> Dict[str, float]:
    """{metric: value for each chosen metric, "examples": how many} of summed statistics
    (empty without examples). Accuracies and ROUGE-L in [0, 1], BLEU in [0, 100]."""
    n = int(stats.get("examples", 0))
    if n == 0:
        return {}
    out: Dict[str, float] = {}
    for name in scoring.metrics:
        if name == "bleu":
            out[name] = bleu_of_counts([stats[k] for k in BLEU_KEYS])
        elif name == "rouge_l":
            out[name] = stats["rouge_l_sum"] / ROUGE_SCALE / n
        else:
            out[name] = stats[COUNT_KEYS[name]] / n
    out["examples"] = n
    return out


def line(metrics: Mapping[str, float]) -> str:
    """`scores`' numbers as the log line writes them, four decimals each, in METRICS order:
    'exact match: 0.5000 | ... | BLEU: 12.3456 | 16 examples'."""
    parts = [f"{LABELS[name]}: {metrics[name]:.4f}" for name in METRICS if name in metrics]
    parts.append(f"{int(metrics['examples'])} examples")
    return " | ".join(parts)
