"""The demo's step-1 losses that docs/model-and-moe.md quotes for the two initializations
("t5x", the default, and "hf"): the quickstart's own trainer command (read from
launch/quickstart.sh) on its corpus and tokenizer, at its 2 processes, for one step."""

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from data_tools import make_demo_corpus, preprocess_data, train_tokenizer
from harness import run_workers
from train_workers import run_pretrain

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "model-and-moe.md"
QUICKSTART = REPO / "launch" / "quickstart.sh"
LEFT_OUT = {"--save": 1, "--save-interval": 1, "--log-file": 1, "--tensorboard-dir": 1}
"""Flags of the quickstart's command that write files, with their value counts: not needed for
the first step's loss."""


def quickstart_trainer_flags(demo: Path):
    """(processes, the trainer's flags) of launch/quickstart.sh, its variables filled in."""
    text = QUICKSTART.read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "-m megatron.pretrain_t5" in line)
    nproc = re.search(r"NPROC=\$\{NPROC:-(\d+)\}", text).group(1)
    steps = re.search(r"STEPS=\$\{STEPS:-(\d+)\}", text).group(1)
    line = (line.replace('"$DEMO_DIR', f'"{demo}').replace('"$STEPS"', steps)
            .replace('"$NPROC"', nproc))
    words = shlex.split(line.split("-m megatron.pretrain_t5", 1)[1])
    flags, i = [], 0
    while i < len(words):
        skip = LEFT_OUT.get(words[i])
        if skip is None:
            flags.append(words[i])
            i += 1
        else:
            i += 1 + skip
    return int(nproc), flags


def page_figure(pattern: str) -> str:
    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    match = re.search(pattern, text)
    assert match, f"docs/model-and-moe.md no longer says {pattern!r}"
    return match.group(1)


def assert_shown(figure: str, measured: float, what: str) -> None:
    """The page's figure is the measured value to the digits it shows (half a unit of its last
    digit: the run's last bits may differ between machines)."""
    decimals = len(figure.partition(".")[2])
    assert measured == pytest.approx(float(figure), abs=0.5 * 10 ** -decimals), \
        f"docs/model-and-moe.md: {what} is {figure}, the run's is {measured:.4f}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The quickstart's corpus, tokenizer and document dataset (steps 1-3 of quickstart.sh)."""
    demo = tmp_path_factory.mktemp("demo")
    corpus = str(demo / "corpus.jsonl")
    assert make_demo_corpus.main(["--output", corpus]) == 0
    assert train_tokenizer.main(["--input", corpus, "--output-prefix", str(demo / "spm"),
                                 "--vocab-size", "4000", "--character-coverage", "1.0"]) == 0
    assert preprocess_data.main(["--input", corpus, "--output-prefix", str(demo / "demo"),
                                 "--tokenizer-model", str(demo / "spm.model"),
                                 "--append-eod", "--workers", "1", "--no-progress"]) == 0
    return demo


def test_the_demos_first_losses_are_the_pages(demo):
    nproc, flags = quickstart_trainer_flags(demo)
    at = flags.index("--model-config") + 1
    config = flags[at] = REPO / flags[at]  # quickstart.sh runs from the repository
    hf = demo / "t5-demo-hf.json"
    hf.write_text(json.dumps({**json.loads(config.read_text()), "init_method": "hf"}))
    # one step, no data workers (the ranks are daemonic processes here), no final evaluation
    one_step = [str(f) for f in flags] + ["--exit-interval", "1", "--num-workers", "0"]
    with_hf = one_step + ["--model-config", str(hf)]  # argparse keeps the last
    t5x, hf_run = run_workers(nproc, run_pretrain, [one_step, with_hf], timeout=600)[0]
    assert_shown(page_figure(r"the demo's step 1: (\d+\.\d+)"), t5x["losses"][1],
                 "the demo's step-1 loss with t5x's initialization")
    vocab = json.loads(config.read_text())["vocab_size"]
    assert_shown(page_figure(rf"ln {vocab} = (\d+\.\d+)"), math.log(vocab), f"ln {vocab}")
    assert_shown(page_figure(r"the demo's step-1 loss (\d+\.\d+)"), hf_run["losses"][1],
                 "the demo's step-1 loss with Hugging Face's initialization")
