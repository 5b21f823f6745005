"""megatron/evaluation/task_metrics.py against the libraries' own scores on the fixed prediction
files of tests/data/finetune (English and Chinese), its statistics summed over parts against
the whole file (how validation reduces them over data-parallel ranks), the first-token choice
over label words, the flags' problems, and data_tools/score_predictions.py."""

import json
from pathlib import Path

import pytest
import torch

from megatron.evaluation import task_metrics as tm
from megatron.training.finetune_metrics import read_predictions

FINETUNE = Path(__file__).resolve().parents[1] / "data" / "finetune"
EN = FINETUNE / "summaries_predictions.jsonl"
LABELS_EN = FINETUNE / "predictions.jsonl"
ZH = FINETUNE / "zh" / "lcsts_predictions.jsonl"
LABELS_ZH = FINETUNE / "zh" / "lcqmc_predictions.jsonl"
ALL_GENERATED = ("exact_match", "label_accuracy", "rouge_l", "bleu")


def rouge_score_mean(predictions, targets, tokenizer=None):
    """rouge-score's own ROUGE-L F-measure, averaged over the examples."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=tokenizer)
    return sum(scorer.score(t, p)["rougeL"].fmeasure
               for p, t in zip(predictions, targets)) / len(targets)


def lcs_f1_of_characters(predictions, targets):
    """A hand reference of character-level ROUGE-L F1 (CPM-2-Finetune's my_lcs on `list(text)`
    with beta 1: 2 lcs / (len(p) + len(t)))."""
    def lcs(a, b):
        row = [0] * (len(b) + 1)
        for x in a:
            prev = 0
            for j, y in enumerate(b, 1):
                prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
        return row[-1]

    total = 0.0
    for p, t in zip(predictions, targets):
        p, t = [c for c in p if not c.isspace()], [c for c in t if not c.isspace()]
        n = lcs(p, t)
        total += 2 * n / (len(p) + len(t)) if n else 0.0
    return total / len(targets)


def parts(rows, cuts=(3, 5)):
    """`rows` cut at `cuts`: three uneven parts (as data-parallel ranks hold them)."""
    edges = (0, *cuts, len(rows))
    return [rows[a:b] for a, b in zip(edges[:-1], edges[1:])]


def test_english_rouge_l_and_bleu_are_the_libraries():
    import sacrebleu

    predictions, targets = read_predictions(str(EN))
    assert len(predictions) == 8
    scoring = tm.Scoring.of(("exact_match", "rouge_l", "bleu"))
    got = tm.scores(scoring, tm.statistics(scoring, predictions, targets))
    assert got["examples"] == 8
    assert got["exact_match"] == 1 / 8  # the library row: prediction == target
    assert got["rouge_l"] == pytest.approx(rouge_score_mean(predictions, targets), rel=1e-9)
    assert 0.3 < got["rouge_l"] < 0.9
    want = sacrebleu.corpus_bleu(predictions, [targets]).score  # 13a, its default
    assert got["bleu"] == pytest.approx(want, rel=1e-12) and 5 < want < 60


def test_chinese_rouge_l_by_characters_and_bleu_zh_are_the_libraries():
    import sacrebleu

    predictions, targets = read_predictions(str(ZH))
    assert len(predictions) == 20
    scoring = tm.Scoring.of(("rouge_l", "bleu"), bleu_tokenize="zh", rouge_tokenize="chars")
    got = tm.scores(scoring, tm.statistics(scoring, predictions, targets))

    class Characters:  # rouge-score's tokenizer interface, written here
        def tokenize(self, text):
            return list(text.replace(" ", ""))

    assert got["rouge_l"] == pytest.approx(rouge_score_mean(predictions, targets, Characters()),
                                           rel=1e-9)
    assert got["rouge_l"] == pytest.approx(lcs_f1_of_characters(predictions, targets), rel=1e-9)
    want = sacrebleu.corpus_bleu(predictions, [targets], tokenize="zh").score
    assert got["bleu"] == pytest.approx(want, rel=1e-12) and 10 < want < 80
    # the defaults (words, 13a) are the libraries' too, and wrong for Chinese: rouge-score's
    # tokenizer keeps ASCII words only, 13a keeps a whole sentence as one token
    plain = tm.Scoring.of(("rouge_l", "bleu"))
    words = tm.scores(plain, tm.statistics(plain, predictions, targets))
    assert words["rouge_l"] == rouge_score_mean(predictions, targets) == 0.0
    assert words["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [targets]).score)
    assert words["bleu"] < got["bleu"] / 2


@pytest.mark.parametrize("path,scoring", [
    (EN, tm.Scoring.of(ALL_GENERATED, ("the library will stay open until ten in the evening",))),
    (ZH, tm.Scoring.of(ALL_GENERATED, ("本市新开通两条地铁线路",), "zh", "chars")),
    (LABELS_ZH, tm.Scoring.of(ALL_GENERATED, ("是", "否"), "zh", "chars")),
])
def test_statistics_summed_over_parts_are_the_whole_files(path, scoring):
    """Validation sums each rank's statistics: three uneven parts give the whole file's
    statistics exactly, hence its scores (BLEU is corpus-level: averaging the parts' BLEU would
    not)."""
    predictions, targets = read_predictions(str(path))
    whole = tm.statistics(scoring, predictions, targets)
    summed = tm.empty_statistics(scoring)
    for p, t in zip(parts(predictions), parts(targets)):
        summed = tm.added(summed, tm.statistics(scoring, p, t))
    assert summed == whole
    assert all(isinstance(v, int) for v in summed.values())
    assert tm.scores(scoring, summed) == tm.scores(scoring, whole)
    bleu = tm.scores(scoring, whole)["bleu"]
    if path != LABELS_ZH:  # (one-character labels: no 2-gram, BLEU 0 whatever the split)
        part_bleu = [tm.scores(scoring, tm.statistics(scoring, p, t))["bleu"]
                     for p, t in zip(parts(predictions), parts(targets))]
        assert bleu > 0 and sum(part_bleu) / 3 != pytest.approx(bleu, rel=1e-3)
    assert tm.scores(scoring, tm.empty_statistics(scoring)) == {}


def test_label_accuracy_of_the_chinese_label_file():
    predictions, targets = read_predictions(str(LABELS_ZH))
    # counted by hand: 20 rows; rows 4 and 19 predict 否 for 是, row 17 writes 对 (no label
    # word): 17 right; row 14's "是 " counts as 是 (stripped); 10 rows are 是 and right
    scoring = tm.Scoring.of(("exact_match", "label_accuracy"), ("是", "否"))
    got = tm.scores(scoring, tm.statistics(scoring, predictions, targets))
    assert got == {"exact_match": 17 / 20, "label_accuracy": 17 / 20, "examples": 20}
    assert tm.label_accuracy(predictions, targets, ["是"]) == 10 / 20  # 否 is no label now


def test_first_token_choice_over_the_label_words():
    encode = {"yes": [7, 3], "no": [5], "maybe": [9, 9]}.__getitem__
    ids = tm.first_token_ids(["yes", "no", "maybe"], encode)
    assert ids == [7, 5, 9]
    logits = torch.full((3, 12), -5.0)
    logits[0, [7, 5, 9]] = torch.tensor([1.0, 2.0, 0.5])
    logits[1, [7, 5, 9, 11]] = torch.tensor([3.0, 2.0, 0.5, 9.0])  # 11: no label's first token
    logits[2, [7, 5, 9]] = torch.tensor([1.0, 1.0, 0.0])  # a tie: the earlier word
    chosen = tm.first_token_labels(logits, ids, ["yes", "no", "maybe"])
    assert chosen == ["no", "yes", "yes"]
    scoring = tm.Scoring.of(("first_token_accuracy",), ("yes", "no", "maybe"))
    assert not scoring.generates
    stats = tm.statistics(scoring, None, ["no", "no", " yes "], chosen)
    assert tm.scores(scoring, stats) == {"first_token_accuracy": 2 / 3, "examples": 3}


def test_label_words_sharing_a_first_token_are_refused():
    encode = {"yes": [7, 3], "yeah": [7, 4], "no": [5], "": []}.__getitem__
    with pytest.raises(ValueError, match=r"^--label-words: 'yes' and 'yeah' begin with the same "
                                         r"token \(id 7\)"):
        tm.first_token_ids(["yes", "no", "yeah"], encode)
    with pytest.raises(ValueError, match="--label-words: '' has no tokens"):
        tm.first_token_ids(["no", ""], encode)


def test_every_problem_of_the_flags_is_listed_at_once():
    flags = {"finetune_data": "t.jsonl", "finetune_valid_data": "v.jsonl",
             "finetune_metrics": "exact_match,first_token_accuracy,rouge,exact_match",
             "eval_num_beams": 0, "eval_bleu_tokenize": "zh", "eval_rouge_tokenize": "chars"}
    assert tm.flag_problems(flags) == [
        "--finetune-metrics names exact_match twice",
        "--finetune-metrics: unknown metric 'rouge' (choose from exact_match, label_accuracy, "
        "first_token_accuracy, rouge_l, bleu)",
        "--finetune-metrics first_token_accuracy needs --label-words (the label task's words)",
        "--eval-num-beams must be at least 1, not 0",
        "--eval-bleu-tokenize needs bleu in --finetune-metrics",
        "--eval-rouge-tokenize needs rouge_l in --finetune-metrics"]
    assert tm.flag_problems({**flags, "finetune_metrics": "first_token_accuracy,bleu",
                             "label_words": ["a"], "eval_num_beams": 2,
                             "eval_bleu_tokenize": "nope", "eval_rouge_tokenize": None}) == [
        "--eval-bleu-tokenize nope: not one of sacrebleu's tokenizers "
        f"({', '.join(tm.bleu_tokenizers())})"]
    assert tm.flag_problems({**flags, "finetune_metrics": "first_token_accuracy",
                             "label_words": ["a"], "eval_num_beams": 3,
                             "eval_bleu_tokenize": None, "eval_rouge_tokenize": None}) == [
        "--eval-num-beams 3: none of the metrics (first_token_accuracy) generates text (beam "
        "search serves exact_match, label_accuracy, rouge_l and bleu)"]
    assert tm.flag_problems({"finetune_data": None, "finetune_metrics": "bleu"}) == [
        "--finetune-metrics needs --finetune-data (it scores fine-tuning's validation)"]
    assert tm.flag_problems({"finetune_data": "t.jsonl", "finetune_metrics": "bleu"}) == [
        "--finetune-metrics needs --finetune-valid-data (it scores the validation)"]
    # the default: exact match, and label accuracy with label words
    assert tm.flag_problems({"finetune_data": "t.jsonl", "label_words": ["a"]}) == []
    assert tm.Scoring.of(label_words=("a",)).metrics == ("exact_match", "label_accuracy")
    assert tm.Scoring.of(("bleu", "exact_match")).metrics == ("exact_match", "bleu")


def test_the_log_line_names_each_metric():
    assert tm.line({"bleu": 12.345678, "exact_match": 0.5, "rouge_l": 0.25,
                    "first_token_accuracy": 0.75, "label_accuracy": 1.0, "examples": 16}) == (
        "exact match: 0.5000 | label accuracy: 1.0000 | first-token accuracy: 0.7500 | "
        "ROUGE-L: 0.2500 | BLEU: 12.3457 | 16 examples")


def test_score_predictions_scores_a_generate_output_against_its_input(tmp_path, capsys):
    """data_tools/score_predictions.py on megatron.generate's output (`text` lines) and the
    input file holding the targets: the libraries' numbers."""
    import sacrebleu

    from data_tools import score_predictions

    predictions, targets = read_predictions(str(ZH))
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"text": p, "ids": [1]}, ensure_ascii=False) + "\n"
                           for p in predictions), encoding="utf-8")
    rc = score_predictions.main(["--predictions", str(out), "--targets", str(ZH),
                                 "--metrics", "rouge_l,bleu,exact_match",
                                 "--eval-rouge-tokenize", "chars", "--eval-bleu-tokenize", "zh"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert got["examples"] == 20 and got["exact_match"] == 2 / 20
    assert got["rouge_l"] == pytest.approx(lcs_f1_of_characters(predictions, targets), rel=1e-9)
    assert got["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(predictions, [targets], tokenize="zh").score, rel=1e-12)
    short = tmp_path / "short.jsonl"
    short.write_text(out.read_text(encoding="utf-8").split("\n", 1)[1], encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        score_predictions.main(["--predictions", str(short), "--targets", str(ZH),
                                "--metrics", "first_token_accuracy"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: --metrics first_token_accuracy needs --label-words (the label task's words)",
        "error: --metrics first_token_accuracy reads the model's first decoder step: a "
        "prediction file cannot give it (fine-tuning's validation does)",
        f"error: --predictions {short} has 19 lines, --targets {ZH} 20: give the file the "
        "predictions were made from"]
