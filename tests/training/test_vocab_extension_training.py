"""Training continues from a checkpoint grown to an extended vocabulary (CPM-2's bilingual
stage; data_tools/train_tokenizer.py --extend, convert_checkpoint.py --extend-vocab): the old
tokenizer comes from the run's recorded flags, and the grown checkpoint loads at TP 1 and TP 2,
from its weights (--finetune) and resuming with its optimizer states (which change step 4
against --no-load-optim)."""

import json
import math

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain

pytestmark = pytest.mark.slow


def test_training_continues_from_the_extended_checkpoint(train_data, corpora_dir, tmp_path):
    from data_tools import convert_checkpoint, train_tokenizer
    from megatron.data.tokenizers.tokenizer import T5Tokenizer

    ckpt = tmp_path / "ckpt"
    run_workers(1, run_pretrain, [base_argv(train_data, "--save", str(ckpt), iters=2)],
                timeout=600)
    english = tmp_path / "en.jsonl"
    with open(corpora_dir / "en_wikitext2.jsonl", encoding="utf-8") as src, \
            open(english, "w", encoding="utf-8") as f:
        for _, line in zip(range(20), src):
            f.write(line)
    new = tmp_path / "t5_en"
    assert train_tokenizer.main(["--extend", train_data.spm, "--input", str(english),
                                 "--add-pieces", "600", "--output-prefix", str(new),
                                 "--character-coverage", "1.0", "--num-threads", "1"]) == 0
    old_tok, new_tok = T5Tokenizer(train_data.spm), T5Tokenizer(f"{new}.model")
    assert new_tok.vocab_size > old_tok.vocab_size
    out = tmp_path / "extended"
    # the old tokenizer: the run's --tokenizer-model, read from its meta.json
    assert convert_checkpoint.main(["--load", str(ckpt), "--to", "megatron", str(out),
                                    "--extend-vocab", f"{new}.model", "--no-progress"]) == 0
    config = json.loads((out / "model_config.json").read_text())
    assert config["vocab_size"] == new_tok.vocab_size

    def run(*extra, iters):
        argv = base_argv(train_data, "--load", str(out), *extra, model=str(out /
                         "model_config.json"), iters=iters)
        argv[argv.index("--tokenizer-model") + 1] = f"{new}.model"
        return argv

    tp2 = ["--tensor-model-parallel-size", "2"]
    weights_tp1, weights_tp2, resumed_tp1, resumed_tp2, fresh = run_workers(2, run_pretrain, [
        run("--finetune", "--lr", "0", iters=2), run("--finetune", "--lr", "0", *tp2, iters=2),
        run("--use-new-lr", iters=4), run("--use-new-lr", *tp2, iters=4),
        run("--use-new-lr", "--no-load-optim", iters=4)], timeout=1200)[0]
    # the same model at TP 1 and TP 2: the same evaluation losses
    assert [e[:2] for e in weights_tp1["evals"]] == [e[:2] for e in weights_tp2["evals"]]
    assert [e[2] for e in weights_tp2["evals"]] == pytest.approx(
        [e[2] for e in weights_tp1["evals"]], rel=2e-5)
    # resumed with the optimizer states: steps 3 and 4, finite, the same in both layouts
    for result in (resumed_tp1, resumed_tp2):
        assert sorted(result["losses"]) == [3, 4]
        assert all(math.isfinite(v) for v in result["losses"].values())
    assert [resumed_tp2["losses"][i] for i in (3, 4)] == pytest.approx(
        [resumed_tp1["losses"][i] for i in (3, 4)], rel=1e-4)
    # ... and the states were used: step 3 (the loaded weights, before any update) is the
    # run's without them (--no-load-optim), step 4 (after an update with the loaded Adam
    # moments) is not (1.4e-3 apart): a load that dropped the moments gives --no-load-optim's
    assert sorted(fresh["losses"]) == [3, 4]
    assert fresh["losses"][3] == pytest.approx(resumed_tp1["losses"][3], rel=1e-6)
    assert abs(fresh["losses"][4] - resumed_tp1["losses"][4]) > 1e-4 * fresh["losses"][4], \
        (fresh["losses"], resumed_tp1["losses"])
