"""`python -m megatron.evaluate`'s command line: the harness's flag names with dashes and with
underscores, and every problem found before a model is built listed at once (exit 2)."""

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
