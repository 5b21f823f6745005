"""README.md and docs/*.md run as written.

- Every ```python block runs, top to bottom, in a folder prepared with the files the snippets
  name (data/mix_text_document.bin/.idx from the session's corpus, spm/t5.model); a name a
  snippet uses without defining it (`batch`: what the loader yields) is given at a tiny size.
- Every shell command (```bash blocks, `$ ` lines and command lines of other blocks, inline
  `python ...`, `make ...`, `pip install ...` spans) names a script, module, make target or
  package extra that exists, and every `--flag` it writes is a flag of the tool it is given to:
  read from that tool's own `--help` (torchrun's and sbatch's too); the arguments of a launch/
  script are the trainer's. Placeholders (`...`, `<...>`, `[...]` brackets) are dropped; the
  flags inside brackets are still checked.
- The `--dry-run` reports and the planner's report quoted in the docs are what the quoted
  commands print; so are the figures the prose quotes (docs/ul2.md's shortest encoders, read
  from its table and checked by the trainer's dry run).
- "`name(...)` (in `path.py`)" names a function that path defines.

Nothing is skipped: a command this test cannot place is a failure naming its file and line; the
few commands that are not ours (CPM-2's original launch line) are listed in NOT_OURS, and each
entry must still match a command of the docs."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Set, Tuple

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
PROGRAMS = ("launch/", "bench/", "data_tools/")
NOT_OURS = {
    "pretrain_enc_dec.py": "CPM-2-Pretrain's own launch line, quoted to show the same run in our "
                           "flags; its script and flags are CPM-2's",
}
TRAINER = "megatron.pretrain_t5"
TAKES_TRAINER_FLAGS = {"data_tools/inspect_dataset.py": "--samples"}
"""Tools that pass the flags they do not know to the trainer's parser when given this flag (their
--help says so: inspect_dataset --samples builds samples as the trainer does)."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks() -> List[Block]:
    out = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        start = None
        for i, line in enumerate(lines):
            if line.startswith("```"):
                if start is None:
                    start, lang = i, line[3:].strip()
                else:
                    out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:i])))
                    start = None
    return out


def inline_commands() -> List[Tuple[str, str]]:
    """(where, command) for the inline code spans that are command lines."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                      flags=re.S | re.M)
        for number, line in enumerate(text.splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith(("python ", "torchrun ", "make ", "sbatch ", "pip install ")) \
                        or (span.startswith(PROGRAMS) and " " in span):
                    out.append((f"{path.relative_to(REPO)}:{number}", span))
    return out


def block_commands(block: Block) -> List[Tuple[str, str]]:
    """(where, command) of a block: every line of a bash block, else the `$ ` lines and lines
    that start with a program (the rest is output); continuation lines joined."""
    out, pending, first = [], None, 0
    for offset, raw in enumerate(block.text.splitlines(), 1):
        line = raw.strip()
        if pending is not None:
            pending += " " + line.rstrip("\\")
        elif line.startswith("$ "):
            pending, first = line[2:].rstrip("\\"), offset
        elif line and not line.startswith("#") and (
                block.lang in ("bash", "sh", "shell") or is_program(line)):
            pending, first = line.rstrip("\\"), offset
        else:
            continue
        if not line.endswith("\\"):
            out.append((f"{block.path.relative_to(REPO)}:{block.line + first}", pending))
            pending = None
    return out


def is_program(line: str) -> bool:
    """Whether a line of a block's output is a command line instead."""
    word = line.split()[0]
    return word in ("python", "torchrun", "make", "sbatch", "pip") or word.startswith(PROGRAMS)


def all_commands() -> List[Tuple[str, str]]:
    out = []
    for block in fenced_blocks():
        if block.lang != "python":
            out += block_commands(block)
    return out + inline_commands()


# A tool's flags, from its own --help -----------------------------------------------------------
def flags_in_help(text: str) -> Set[str]:
    """The option strings of argparse's (or Slurm's) --help: the invocation part of each option
    line (before the help text), not flags that help texts mention."""
    flags = set()
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("-") and len(line) - len(stripped) < 10:
            invocation = re.split(r"\s{2,}", stripped)[0]
            flags.update(re.findall(r"(?<![\w-])--?[A-Za-z0-9][\w-]*", invocation))
    return flags


@lru_cache(maxsize=None)
def tool_flags(tool: str) -> frozenset:
    """A tool's flags: a module name, a script path under the repository, 'torchrun' or
    'sbatch'."""
    if tool == "torchrun":
        from torch.distributed.run import get_args_parser
        return frozenset(flags_in_help(get_args_parser().format_help()))
    if tool == "sbatch":  # its --help reads a config first: a minimal one, no cluster needed
        with tempfile.TemporaryDirectory() as folder:
            conf = Path(folder) / "slurm.conf"
            conf.write_text("ClusterName=docs\nSlurmctldHost=localhost\n"
                            "NodeName=localhost CPUs=1 State=UNKNOWN\n"
                            "PartitionName=docs Nodes=localhost Default=YES\n")
            text = subprocess.run(["sbatch", "--help"], capture_output=True, text=True,
                                  check=True, env={**os.environ, "SLURM_CONF": str(conf)}).stdout
        return frozenset(flags_in_help(text))
    # data_tools/ and bench/ are packages: a script is its module
    module = importlib.import_module(tool[:-3].replace("/", ".") if tool.endswith(".py")
                                     else tool)
    if not hasattr(module, "main"):
        module = importlib.import_module(f"{tool}.__main__")
    assert hasattr(module, "main"), f"{tool} has no main(argv) to ask for --help"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    return frozenset(flags_in_help(out.getvalue()))


def check_flags(where: str, tool: str, args: List[str], problems: List[str]) -> None:
    written = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    if not written:
        return
    known = tool_flags(tool)
    if TAKES_TRAINER_FLAGS.get(tool) in written:
        known = known | tool_flags(TRAINER)
    for flag in written:
        if flag not in known:
            problems.append(f"{where}: {flag} is not a flag of {tool}")


# Placing a command -----------------------------------------------------------------------------
def tokens(command: str) -> List[str]:
    text = re.sub(r"<[^<>]*>", " ", command)  # <the GPU flags above>
    text = re.sub(r"(?<!\S)\[|\](?!\S)", " ", text)  # [--json]: checked like the others
    words = shlex.split(text, comments=True)
    for stop in ("|", "&&", ";"):  # the first command of a pipe or list is ours
        if stop in words:
            words = words[:words.index(stop)]
    return [w for w in words if w not in ("...", "…")]


def check_command(where: str, command: str, problems: List[str]) -> None:
    words = tokens(command)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        if value and is_program(value):  # LAUNCHER="python -m megatron.pretrain_t5 --dry-run"
            check_command(f"{where} ({name})", value, problems)
    if not words:
        problems.append(f"{where}: no command in {command!r}")
        return
    program, args = words[0], words[1:]
    if program in ("python", "python3"):
        check_python(where, args, problems)
    elif program == "torchrun":
        check_launcher(where, "torchrun", args, problems)
    elif program == "sbatch":
        check_launcher(where, "sbatch", args, problems)
    elif program == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
        problems += [f"{where}: make has no target {t!r}" for t in args if t not in targets]
    elif program == "pip":
        check_pip(where, args, problems)
    elif program.startswith(("launch/", "bench/", "data_tools/")):
        check_script(where, program, args, problems)
    else:
        problems.append(f"{where}: {program!r} is not a command this test knows: {command!r}")


def check_python(where: str, args: List[str], problems: List[str]) -> None:
    if args[:1] == ["-m"]:
        module = args[1]
        if module == "torch.distributed.launch" and any(a in NOT_OURS for a in args):
            return
        if importlib.util.find_spec(module) is None:
            problems.append(f"{where}: no module {module}")
            return
        check_flags(where, module, args[2:], problems)
    else:
        check_script(where, args[0], args[1:], problems)


def check_script(where: str, script: str, args: List[str], problems: List[str]) -> None:
    if script in NOT_OURS:
        return
    if "*" in script:
        if not list(REPO.glob(script)):
            problems.append(f"{where}: nothing matches {script}")
        return
    if not (REPO / script).is_file():
        problems.append(f"{where}: no file {script}")
        return
    if script == "launch/slurm/preprocess.sbatch":  # hands its arguments to preprocess_data.py
        check_flags(where, "data_tools/preprocess_data.py", args, problems)
    elif script.startswith("launch/"):  # the launch scripts hand their arguments to the trainer
        check_flags(where, TRAINER, args, problems)
    else:
        check_flags(where, script, args, problems)


def check_launcher(where: str, launcher: str, args: List[str], problems: List[str]) -> None:
    """torchrun [its flags] -m MODULE|SCRIPT [its flags]; sbatch [its flags] SCRIPT [args]."""
    own, i = [], 0
    while i < len(args) and args[i] != "-m" and not args[i].endswith((".py", ".sh", ".sbatch")):
        own.append(args[i])
        i += 1
    check_flags(where, launcher, own, problems)
    if i == len(args):
        problems.append(f"{where}: {launcher} runs nothing")
    elif args[i] == "-m":
        if importlib.util.find_spec(args[i + 1]) is None:
            problems.append(f"{where}: no module {args[i + 1]}")
        else:
            check_flags(where, args[i + 1], args[i + 2:], problems)
    else:
        check_script(where, args[i], args[i + 1:], problems)


def check_pip(where: str, args: List[str], problems: List[str]) -> None:
    extras = set(importlib.metadata.metadata("t5-pretrain").get_all("Provides-Extra") or [])
    for arg in args:
        match = re.match(r"^(\.|t5-pretrain)\[([\w,-]+)\]$", arg)
        if match:
            problems += [f"{where}: t5-pretrain has no extra {e!r}"
                         for e in match.group(2).split(",") if e not in extras]
        elif arg.startswith(".") or arg.startswith("t5-pretrain"):
            problems.append(f"{where}: cannot read {arg!r}")


def test_every_command_names_a_real_tool_and_real_flags():
    commands = all_commands()
    assert len(commands) > 30, commands  # the README's day with the tools and the docs' commands
    problems: List[str] = []
    for where, command in commands:
        try:
            check_command(where, command, problems)
        except ValueError as e:  # shlex: unbalanced quotes
            problems.append(f"{where}: {e}: {command!r}")
    assert not problems, "\n".join(problems)
    for word, why in NOT_OURS.items():  # no stale exemption
        assert any(word in command for _, command in commands), (word, why)


def test_the_docs_pages_are_checked_too():
    """The commands and snippets of every page with code are read, docs/ as well as README."""
    with_code = {p.relative_to(REPO).as_posix() for p in DOCS
                 if "```" in p.read_text(encoding="utf-8")}
    read = {where.rsplit(":", 1)[0] for where, _ in all_commands()} | \
        {b.where.rsplit(":", 1)[0] for b in fenced_blocks()}
    assert {"README.md", "docs/data.md", "docs/training.md", "docs/checkpoints.md"} <= with_code
    assert with_code <= read, with_code - read


def test_the_flag_check_catches_what_it_should():
    """The checks above fail on a wrong flag, script, module, target or extra."""
    problems: List[str] = []
    for command in ("python -m megatron.plan --model-config t5-11b --gpus 8",
                    "python data_tools/convert_checkpoint.py --load x --to-hf y",
                    "python data_tools/nope.py", "python -m megatron.nope",
                    "torchrun --nproc-per-node 2 --nodes 2 -m megatron.pretrain_t5 --lr 1",
                    "sbatch --node 2 launch/slurm/pretrain_t5.sbatch --zero 1",
                    "launch/torchrun.sh --micro-batch 4", "make nope",
                    "pip install -e '.[nope]'"):
        check_command("test", command, problems)
    said = "\n".join(problems)
    for expected in ("--gpus is not a flag of megatron.plan", "--to-hf is not a flag of "
                     "data_tools/convert_checkpoint.py", "no file data_tools/nope.py",
                     "no module megatron.nope", "--nodes is not a flag of torchrun",
                     "--node is not a flag of sbatch",
                     "--zero is not a flag of megatron.pretrain_t5",
                     "--micro-batch is not a flag of megatron.pretrain_t5",
                     "make has no target 'nope'", "no extra 'nope'"):
        assert expected in said, said
    assert "--lr" not in said and "--nproc-per-node" not in said


# Python snippets -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs_checkpoint(spm_model, tmp_path_factory):
    """A tiny random T5 weights checkpoint over the session's SentencePiece model: the
    snippets' `ckpt/`."""
    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import gather_full_state_dict

    config = T5Config(vocab_size=T5Tokenizer(str(spm_model)).vocab_size, d_model=16, d_kv=4,
                      d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("docs_ckpt") / "ckpt"
    write_weights_checkpoint(folder, gather_full_state_dict(T5Model(config)).items(),
                             {"config": config.to_dict(), "make_vocab_size_divisible_by": 128})
    return folder


@pytest.fixture
def prepared_folder(tmp_path, train_data, spm_model, docs_checkpoint, monkeypatch):
    """The files the snippets name, in a folder they run in: the data, the tokenizer, a
    checkpoint, the repository's tests/data (task files)."""
    (tmp_path / "data").mkdir()
    for suffix in (".bin", ".idx"):
        (tmp_path / "data" / f"mix_text_document{suffix}").symlink_to(train_data.prefix + suffix)
    (tmp_path / "spm").mkdir()
    (tmp_path / "spm" / "t5.model").symlink_to(spm_model)
    (tmp_path / "ckpt").symlink_to(docs_checkpoint)
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "tests" / "data" / "eval_tasks").symlink_to(REPO / "tests" / "data" /
                                                           "eval_tasks")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tiny_batch(vocab: int = 32000, batch: int = 2, encoder: int = 16, decoder: int = 8
               ) -> Dict[str, torch.Tensor]:
    """What the loader yields, at a tiny size (keys and dtypes of megatron/data)."""
    g = torch.Generator().manual_seed(0)
    return {"encoder_input_ids": torch.randint(2, vocab, (batch, encoder), generator=g),
            "decoder_input_ids": torch.randint(2, vocab, (batch, decoder), generator=g),
            "encoder_attention_mask": torch.ones(batch, encoder, dtype=torch.long),
            "decoder_attention_mask": torch.ones(batch, decoder, dtype=torch.long),
            "labels": torch.randint(2, vocab, (batch, decoder), generator=g)}


PYTHON_BLOCKS = [b for b in fenced_blocks() if b.lang == "python"]


def test_there_are_python_snippets():
    assert len(PYTHON_BLOCKS) >= 2, [b.where for b in PYTHON_BLOCKS]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_snippet_runs(block, prepared_folder):
    namespace = {"__name__": "__docs__", "batch": tiny_batch()}
    exec(compile(block.text, block.where, "exec"), namespace)


def test_named_functions_are_where_the_docs_say():
    """"`read_hf_checkpoint(...)` (in `megatron/checkpoint/formats/hf.py`)": that file defines
    it."""
    found = 0
    for path in DOCS:
        text = " ".join(path.read_text(encoding="utf-8").split())
        for name, where in re.findall(r"`(\w+)\([^`]*\)` \(in `([\w/]+\.py)`\)", text):
            found += 1
            source = (REPO / where).read_text(encoding="utf-8")
            assert re.search(rf"^(def|class) {name}\b", source, re.M), \
                f"{path.name}: {name} is not defined in {where}"
    assert found, "no '`name(...)` (in `path.py`)' left to check"


# The planner's report --------------------------------------------------------------------------
def quoted_runs(wanted: Callable[[str], bool]) -> List[Tuple[Block, str, List[str]]]:
    """(block, command, the output lines the block quotes) for the blocks that start with a
    `$ ` command that is `wanted`."""
    out = []
    for block in fenced_blocks():
        lines = block.text.splitlines()
        if lines and lines[0].startswith("$ "):
            command, rest = lines[0][2:], lines[1:]
            while command.endswith("\\"):
                command = command[:-1] + " " + rest.pop(0).strip()
            if wanted(command):
                out.append((block, command, rest))
    return out


def matches(quoted: str, real: str) -> bool:
    """A quoted line is the real one, where '...' stands for what the docs left out."""
    parts = [p for p in (s.strip() for s in quoted.split("...")) if p]
    position = 0
    for i, part in enumerate(parts):
        found = real.find(part, position)
        if found < 0 or (i == 0 and not quoted.startswith("...") and found != 0):
            return False
        position = found + len(part)
    return True


def assert_quoted(block: Block, quoted: List[str], real: List[str]) -> None:
    """Each quoted line (but '...' lines) is a line of the real output, in order."""
    at = 0
    for line in quoted:
        if line.strip() in ("", "..."):
            continue
        hit = next((i for i in range(at, len(real)) if matches(line.strip(), real[i].strip())),
                   None)
        assert hit is not None, (f"{block.where}: the docs quote\n  {line.strip()}\nthe "
                                 f"command prints\n  " + "\n  ".join(real))
        at = hit + 1


def trainer_flags_before(block: Block) -> List[str]:
    """The trainer's flags of the last torchrun command before `block` in its file ('<the GPU
    flags above>')."""
    found = None
    for other in fenced_blocks():
        if other.path == block.path and other.line < block.line:
            for _, command in block_commands(other):
                words = tokens(command)
                if words[:1] == ["torchrun"] and TRAINER in words and "..." not in command:
                    found = words[words.index(TRAINER) + 1:]
    assert found, f"{block.where}: no torchrun command above to take the flags from"
    return found


def test_the_dry_run_reports_in_the_docs_are_the_trainers(prepared_folder):
    """The quoted `--dry-run` reports are what the command prints, run in a folder holding the
    files it names: '<the GPU flags above>' is the torchrun command above it, DATA=...,
    TOKENIZER=..., OUT=... are the session's corpus and tokenizer and a folder."""
    runs = quoted_runs(lambda command: re.search(r"--dry-run(?![\w-])", command) is not None)
    assert len(runs) >= 2, [b.where for b, _, _ in runs]
    fill = {"DATA": str(prepared_folder / "data" / "mix_text_document"),
            "TOKENIZER": str(prepared_folder / "spm" / "t5.model"),
            "OUT": str(prepared_folder / "out")}
    for block, command, quoted in runs:
        placeholder = "<the GPU flags above>"
        words = shlex.split(command.replace(placeholder, ""))
        if placeholder in command:
            words += trainer_flags_before(block)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = fill[name] if value == "..." else value
        argv = ([sys.executable] + words[1:] if words[0] == "python" else
                ["bash", str(REPO / words[0])] + words[1:])
        proc = subprocess.run(argv, cwd=prepared_folder, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{block.where}: {command}\n{proc.stderr[-2000:]}"
        assert_quoted(block, quoted, proc.stdout.splitlines())


def test_the_planner_report_in_the_docs_is_the_planners(capsys):
    from megatron.plan.__main__ import main as plan_main

    runs = quoted_runs(lambda command: command.startswith("python -m megatron.plan"))
    assert runs, "the docs quote no planner report"
    for block, command, quoted in runs:
        argv = shlex.split(command)[3:]
        assert plan_main(argv) == 0
        assert_quoted(block, quoted, capsys.readouterr().out.splitlines())


# Figures the prose quotes -----------------------------------------------------------------------
NUMBER_WORDS = {"none": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def page_table(page: str, first_cell: str) -> List[List[str]]:
    """The rows (header first, separator left out) of the table in docs/`page` whose header
    starts with `first_cell`."""
    lines = (REPO / "docs" / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not re.fullmatch(r"[|\s-]+", line):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def ul2_dry_run(folder: Path, preset: str, encoder: int, mode_ids: int) -> Tuple[int, str]:
    """(exit status, stderr) of the trainer's `--dry-run` of a UL2 run at `encoder` tokens with
    mode tokens of `mode_ids` ids each (given as ids: the tokenizer does not matter)."""
    from megatron.pretrain_t5 import main as trainer_main

    argv = ["--dry-run", "--data-path", str(folder / "data" / "mix_text_document"),
            "--tokenizer-model", str(folder / "spm" / "t5.model"),
            "--model-config", str(REPO / "configs" / "model" / "t5-demo.json"),
            "--train-iters", "1", "--lr", "1e-3", "--micro-batch-size", "1",
            "--t5-objective", "ul2", "--ul2-denoisers", preset,
            "--encoder-seq-length", str(encoder)]
    if mode_ids == 0:
        argv.append("--ul2-no-mode-tokens")
    for kind, first in (("r", 10), ("x", 20), ("s", 30)) if mode_ids else ():
        argv += [f"--ul2-{kind}-denoiser-token",
                 ",".join(str(first + i) for i in range(mode_ids))]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = trainer_main(argv)
    return status, err.getvalue()


def test_the_ul2_encoder_lengths_in_the_docs_are_the_trainers(prepared_folder):
    """docs/ul2.md's refused example is refused as it says; in its table of the shortest
    encoder per preset and mode-token length, the dry run passes at that length and is refused
    one token shorter, naming it."""
    text = " ".join((REPO / "docs" / "ul2.md").read_text(encoding="utf-8").split())
    example = re.search(r"X \((\d+), ([\d.]+)\) at encoder (\d+) \(a (\d+)-token window "
                        r"behind (\w+)-piece mode tokens, (\d+) noise tokens\)", text)
    assert example, "docs/ul2.md: the refused example is gone"
    span, rate, encoder, window, pieces, noise = example.groups()
    status, err = ul2_dry_run(prepared_folder, "ul2", int(encoder), NUMBER_WORDS[pieces])
    assert status == 2 and (f"X (span {span}, rate {rate}): a {window}-token window "
                            f"(--encoder-seq-length {encoder}) has {noise} noise tokens") in err, \
        f"docs/ul2.md: {example.group(0)}\n{err}"
    header, *rows = page_table("ul2.md", "mode tokens")
    presets = [re.search(r"`--ul2-denoisers (\w+)`", cell).group(1) for cell in header[1:]]
    assert presets == ["ul2", "upalm"] and len(rows) == 3, (header, rows)
    for label, *figures in rows:
        mode_ids = NUMBER_WORDS[label.split()[0]]
        for preset, figure in zip(presets, figures):
            shortest = int(figure)
            status, err = ul2_dry_run(prepared_folder, preset, shortest, mode_ids)
            assert status == 0, f"docs/ul2.md: {label}, {preset}: {shortest} is refused:\n{err}"
            status, err = ul2_dry_run(prepared_folder, preset, shortest - 1, mode_ids)
            assert status == 2 and f"--encoder-seq-length {shortest} or more" in err, \
                f"docs/ul2.md: {label}, {preset}: {shortest - 1} is not refused naming " \
                f"{shortest}:\n{err}"
