"""`python -m megatron.evaluate`'s command line: the harness's flag names with dashes and with
underscores, and every problem found before a model is built listed at once (exit 2)."""

import json

import pytest
import torch

from megatron import evaluate


def test_the_harness_spellings_are_both_accepted():
    parser = evaluate.build_parser()
    dashed = parser.parse_args(["--tasks", "a,b", "--include-path", "d", "--num-fewshot", "3",
                                "--batch-size", "4", "--log-samples", "--output-path", "o",
                                "--gen-kwargs", "max_gen_toks=5", "--limit", "0.5"])
    underscored = parser.parse_args(["--tasks", "a,b", "--include_path", "d", "--num_fewshot",
                                     "3", "--batch_size", "4", "--log_samples",
                                     "--output_path", "o", "--gen_kwargs", "max_gen_toks=5",
                                     "--limit", "0.5"])
    assert vars(dashed) == vars(underscored)
    assert (dashed.include_path, dashed.num_fewshot, dashed.batch_size, dashed.log_samples,
            dashed.output_path, dashed.limit) == ("d", 3, 4, True, "o", 0.5)
    assert evaluate._limit(0.5) == 0.5 and evaluate._limit(10.0) == 10


def test_every_problem_is_listed_at_once(tmp_path, capsys):
    code = evaluate.main(["--include-path", str(tmp_path / "none"), "--log-samples",
                          "--batch-size", "0", "--seed", "1,2", "--load",
                          str(tmp_path / "nockpt"), "--tensor-model-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 2
    for expected in ("--tasks is required", "--batch-size must be at least 1, not 0",
                     "--log-samples needs --output-path",
                     f"--include-path {tmp_path / 'none'}: no such folder",
                     "--seed 1,2: one integer or four",
                     "--tensor-model-parallel-size 3 does not divide the number of processes",
                     f"--load {tmp_path / 'nockpt'}"):
        assert expected in err, (expected, err)


def test_an_unknown_task_is_named(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("task: mine\ndataset_path: json\n"
                                        "output_type: generate_until\n")
    code = evaluate.main(["--tasks", "mine,no_such_task_anywhere", "--include-path",
                          str(tmp_path), "--load", str(tmp_path / "nockpt")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--tasks: no_such_task_anywhere: no such task" in err, err
    assert "mine" not in err.split("--tasks:")[1].split("\n")[0].split(":")[0]


@pytest.fixture(scope="module")
def tiny(spm_model, tmp_path_factory):
    """(a tiny random checkpoint, a folder with one local multiple-choice task)."""
    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import gather_full_state_dict

    root = tmp_path_factory.mktemp("tiny_eval")
    config = T5Config(vocab_size=T5Tokenizer(str(spm_model)).vocab_size, d_model=16, d_kv=4,
                      d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0)
    torch.manual_seed(0)
    write_weights_checkpoint(root / "ckpt", gather_full_state_dict(T5Model(config)).items(),
                             {"config": config.to_dict(), "make_vocab_size_divisible_by": 128})
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(
        json.dumps({"q": q, "choices": ["yes", "no"], "label": 0}) + "\n"
        for q in ("Is the sky blue?", "Is water wet?", "Do fish swim?")))
    (tasks / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return root / "ckpt", tasks


def _argv(tiny, spm_model, out):
    ckpt, tasks = tiny
    return ["--load", str(ckpt), "--tokenizer-model", str(spm_model), "--tasks", "tiny_mc",
            "--include-path", str(tasks), "--log-samples", "--output-path", str(out),
            "--bootstrap-iters", "0"]


def test_the_harness_files_are_written_whole(tiny, spm_model, tmp_path, capsys):
    out = tmp_path / "results"
    assert evaluate.main(_argv(tiny, spm_model, out)) == 0, capsys.readouterr().err
    assert "tiny_mc" in capsys.readouterr().out  # the harness's table
    folder, = out.iterdir()  # named after --load, as the hf backend names it
    assert folder.name.endswith("ckpt")
    names = sorted(p.name.split("_20")[0] for p in folder.iterdir())
    assert names == ["results", "samples_tiny_mc"]
    results = json.loads(next(folder.glob("results_*.json")).read_text())
    assert results["config"]["model_args"] == {"pretrained": str(tiny[0])}
    assert 0 <= results["results"]["tiny_mc"]["acc,none"] <= 1


@pytest.mark.parametrize("where", ["answering", "writing"])
def test_an_interrupted_evaluation_writes_nothing(where, tiny, spm_model, tmp_path, capsys,
                                                  monkeypatch):
    """Ctrl-C while the requests are answered, or between the harness's two files: exit 130,
    nothing under --output-path (the staging folder removed)."""
    from lm_eval.loggers import EvaluationTracker

    from megatron.evaluation.harness_lm import MegatronT5LM

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "answering":
        monkeypatch.setattr(MegatronT5LM, "_score", interrupt)
    else:
        monkeypatch.setattr(EvaluationTracker, "save_results_samples", interrupt)
    out = tmp_path / "results"
    out.mkdir()
    assert evaluate.main(_argv(tiny, spm_model, out)) == 130
    assert "interrupted; no results were written" in capsys.readouterr().err
    assert list(out.iterdir()) == []
