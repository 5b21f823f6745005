"""A path with a URL scheme that its flag does not read is refused by name, exit 2, before
anything is written: Python would otherwise take `s3://ckpt/run` for the local folder
`s3:/ckpt/run`. Every entry point and data_tools/ tool (the trainer's flags are in
tests/training/test_bad_configs.py); --data-path, inspect_dataset's PREFIX,
preprocess_data's --output-prefix and the checkpoint tools' checkpoints (generate's --load and
--prompt-load, convert_checkpoint's --load, --inspect and --to megatron) keep s3://."""

import importlib
from pathlib import Path

import pytest

from megatron.data.storage.paths import scheme_of, scheme_problems


def test_the_helper_names_the_flag_and_the_local_path_it_would_be():
    assert scheme_of("s3://b/k") == "s3" and scheme_of("GS://b") == "gs"
    assert scheme_of("ckpt/run") is None and scheme_of("C:\\ckpt") is None
    assert scheme_of("a/s3://b") is None  # a scheme is at the start only
    assert scheme_problems("--data-path", ["1", "s3://b/x", "local"], ("s3",)) == []
    [problem] = scheme_problems("--save", "s3://ckpt/run")
    assert problem.startswith("--save s3://ckpt/run: --save takes a local path") \
        and "'s3:/ckpt/run'" in problem
    assert scheme_problems("--load", None) == []


CASES = [
    ("megatron.generate", ["--load", "gs://b/ckpt", "--input", "in.jsonl", "--output",
                           "hdfs://n/out.jsonl"], ["--load gs://b/ckpt", "--output hdfs://"]),
    ("megatron.plot.__main__", ["s3://b/run", "--output", "plots"], ["RUN s3://b/run"]),
    ("megatron.plan.__main__", ["--model-config", "s3://b/t5.json", "--global-batch-size",
                                "8", "--cluster", "1x8xa100-80gb"], ["--model-config s3://"]),
    ("data_tools.convert_checkpoint", ["--load", "ckpt", "--to", "hf", "s3://b/hf"],
     ["--to hf s3://b/hf"]),
    ("data_tools.convert_checkpoint", ["--load", "gs://b/ckpt", "--to", "hf", "out"],
     ["--load gs://b/ckpt"]),
    ("data_tools.inspect_dataset", ["data/x", "--tokenizer-model", "s3://b/t5.model"],
     ["--tokenizer-model s3://"]),
    ("data_tools.merge_datasets", ["--input", "a", "--output-prefix", "s3://b/merged",
                                   "--staging-dir", "s3://b/stage"], ["--staging-dir s3://"]),
    ("data_tools.merge_datasets", ["--input", "gs://b/a", "--output-prefix", "m"],
     ["--input gs://b/a"]),
    ("data_tools.preprocess_data", ["--input", "s3://b/c.jsonl", "--output-prefix", "out",
                                    "--tokenizer-model", "t5.model"], ["--input s3://"]),
    ("data_tools.train_tokenizer", ["--input", "c.jsonl", "--output-prefix", "s3://b/spm"],
     ["--output-prefix s3://b/spm"]),
    ("data_tools.train_punkt", ["--input", "c.jsonl", "--output", "s3://b/punkt.json"],
     ["--output s3://"]),
    ("data_tools.make_demo_corpus", ["--output", "s3://b/demo.jsonl"], ["--output s3://"]),
    ("data_tools.make_flags_doc", ["--output", "s3://b/flags.md"], ["--output s3://b/flags.md"]),
    ("data_tools.build_indices", ["--data-path", "data/x", "--tokenizer-model", "t5.model",
                                  "--data-cache-path", "s3://b/cache", "--train-iters", "1",
                                  "--global-batch-size", "1"], ["--data-cache-path s3://"]),
]


@pytest.mark.parametrize("module,argv,wanted", CASES,
                         ids=[f"{c[0].split('.')[-1]}-{c[2][0].split()[0]}" for c in CASES])
def test_a_tool_refuses_a_scheme_it_does_not_read(module, argv, wanted, tmp_path, monkeypatch,
                                                  capsys):
    monkeypatch.chdir(tmp_path)  # a relative path taken for local would appear here
    main = importlib.import_module(module).main
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's error(): usage and the message, status 2
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    for text in wanted:
        assert text in err, (text, err)
    assert not any(Path(tmp_path).iterdir()), list(Path(tmp_path).iterdir())
