"""What every command does with a command line it cannot parse: one line per problem, printed
once for the job, exit status 2 (docs/troubleshooting.md, "Exit statuses").

argparse's own way is the whole usage text and one error, on every process: 125 lines per rank
for the trainer, a flag from Megatron-LM that was renamed here answered like a typo. Every
entry point and tool builds its parser as `CommandLineParser`, which says instead

    error: unknown flag --use-distributed-optimizer (Megatron-LM / CPM-2): use --zero-stage 1 ...
    error: unknown flag --lr-decay: did you mean --lr-decay-style? (... --help lists every flag)

one line for each unknown flag, on the rank that speaks for the job (`startup_voice`); the
other ranks exit silently once it has printed (`announce_refusal`, `await_refusal`), since a
launcher ends the others as soon as one rank exits. `RENAMED_FLAGS` is the one table of flags
that Megatron-LM or CPM-2-Pretrain accept and this project does not, with what to use instead;
docs/migrating.md lists the same flags (tests/unit/test_command_line.py holds the two together).

No import of the rest of the package: every layer's command may use it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import socket
import sys
import time
from datetime import timedelta
from types import MappingProxyType
from typing import Callable, List, Mapping, NoReturn, Optional, Sequence

_MODEL_CONFIG = "the model's shape comes from --model-config (a JSON file or a preset name)"
_NO_RECOMPUTE = "use --checkpoint-activations (it recomputes whole blocks; selective " \
                "recompute is not available)"
_RESUMES = "remove it (the data loader always resumes)"

RENAMED_FLAGS: Mapping[str, str] = MappingProxyType({  # read-only: no module state
    # Megatron-LM
    "--num-layers": _MODEL_CONFIG,
    "--hidden-size": _MODEL_CONFIG,
    "--num-attention-heads": _MODEL_CONFIG,
    "--kv-channels": _MODEL_CONFIG,
    "--ffn-hidden-size": _MODEL_CONFIG,
    "--init-method-std": _MODEL_CONFIG,
    "--use-distributed-optimizer": "use --zero-stage 1 or higher",
    "--lr-warmup-samples": "use --lr-warmup-iters (--train-samples becomes whole steps; the LR "
                           "flags count steps)",
    "--lr-decay-samples": "use --lr-decay-iters (--train-samples becomes whole steps; the LR "
                          "flags count steps)",
    "--rampup-batch-size": "not available: the global batch is fixed",
    "--recompute-activations": _NO_RECOMPUTE,
    "--recompute-granularity": _NO_RECOMPUTE,
    "--sequence-parallel": "not available",
    # CPM-2-Pretrain
    "--min-scale": "use --min-loss-scale",
    "--cpu-optimizer": "use --offload-optimizer cpu (ZeRO >= 1)",
    "--lazy-loader": _RESUMES,
    "--no-save-optim": _RESUMES,
    "--no-save-rng": _RESUMES,
    "--resume-dataloader": _RESUMES,
    "--eval-batch-size": _RESUMES,
})
"""Flag of Megatron-LM or CPM-2-Pretrain -> what to do here (docs/migrating.md)."""

EXIT_USAGE = 2
"""A command line or input refused before anything starts (docs/troubleshooting.md)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports it)."""

SILENT_RANK_GRACE_S = 10.0
"""The longest a silent rank waits for its node's speaking rank to say it has printed."""
REFUSAL_KEY = "t5-pretrain/command-line-refused"


def unknown_flag_problems(extras: Sequence[str], known: Sequence[str], prog: str,
                          renamed: Mapping[str, str]) -> List[str]:
    """One message per unknown flag of `extras` (what argparse did not recognise; the values
    that follow an unknown flag are its own, not named again): the replacement from `renamed`,
    else the closest of the `known` option strings, else where every flag is listed."""
    problems, after_flag = [], False
    listed = f"({prog} --help lists every flag)"
    for extra in extras:
        if not extra.startswith("-") or _is_number(extra):
            if not after_flag:
                problems.append(f"unexpected argument {extra!r} {listed}")
            continue
        after_flag = True
        flag = extra.split("=", 1)[0]
        if flag in renamed:
            problems.append(f"unknown flag {flag} (Megatron-LM / CPM-2): {renamed[flag]} "
                            f"(docs/migrating.md)")
            continue
        close = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=1)
        hint = f": did you mean {close[0]}? " if close else " "
        problems.append(f"unknown flag {flag}{hint}{listed}")
    return problems


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _Malformed(Exception):
    """argparse's own complaint, raised out of `CommandLineParser.parse_args`."""


class CommandLineParser(argparse.ArgumentParser):
    """argparse's parser with the refusal of the module docstring: every problem argparse finds
    (unknown flags, a missing or malformed value) and every `parser.error(...)` a tool raises
    ends in one line per problem on the speaking rank, nothing on the others, and exit 2.

    renamed: unknown flags that have a replacement (`RENAMED_FLAGS` for the commands that take
        the trainer's flags, which users bring from Megatron-LM and CPM-2; default none).
    job: the command runs as the ranks of a launched job (the trainer, megatron.generate), so
        one rank speaks for all (`refuse`); a tool (default) always speaks for itself: a Slurm
        task running it may have problems of its own.
    """

    def __init__(self, *args, renamed: Optional[Mapping[str, str]] = None, job: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = renamed or {}
        self.job = job
        self._parsing = False  # error() raises _Malformed while parse_args collects

    def parse_args(self, args=None, namespace=None):
        namespace, extras, problems = self.parse_collecting(args, namespace)
        if problems:
            refuse(problems, job=self.job)
        return namespace

    def parse_collecting(self, args=None, namespace=None):
        """(namespace or None, the unrecognised arguments, every problem found: one per
        unknown flag, then argparse's own complaint if it had one). Exits for --help only."""
        args = list(sys.argv[1:] if args is None else args)
        self._parsing = True
        try:
            namespace, extras = self.parse_known_args(args, namespace)
            complaint = []
        except _Malformed as e:  # argparse stops at its first complaint: the flags still count
            namespace, complaint = None, [str(e)]
            extras = [a for a in args if a.startswith("--") and a != "--"
                      and a.split("=", 1)[0] not in self._option_string_actions]
        finally:
            self._parsing = False
        return namespace, extras, self.unknown_problems(extras) + complaint

    def unknown_problems(self, extras: Sequence[str]) -> List[str]:
        """`unknown_flag_problems` of this parser."""
        return unknown_flag_problems(extras, list(self._option_string_actions), self.prog,
                                     self.renamed)

    def refuse_unknown(self, extras: Sequence[str]) -> NoReturn:
        """`refuse` the arguments left over by `parse_known_args`, one line per unknown flag."""
        refuse(self.unknown_problems(extras), job=self.job)

    def error(self, message: str) -> NoReturn:
        if self._parsing:  # argparse's own words: where to look them up
            raise _Malformed(f"{message} ({self.prog} --help lists every flag)")
        refuse([message], job=self.job)  # a tool's parser.error(...): its own words


def refuse(problems: Sequence[str], env: Optional[Mapping[str, str]] = None,
           stopped: Optional[Callable[[], bool]] = None, job: bool = True) -> NoReturn:
    """Say why the command line cannot run, once for the job, and exit 2 (SystemExit): the
    speaking rank prints `error: PROBLEM` for each problem on stderr (a node's first rank
    naming its node), and under a launcher tells its node's silent ranks, which wait for that
    word (`await_refusal`). Not a `job`'s rank: this process speaks, whatever its environment."""
    speak_for_the_job(problems, (os.environ if env is None else env) if job else {}, stopped)
    raise SystemExit(EXIT_USAGE)


def speak_for_the_job(problems: Sequence[str], env: Mapping[str, str],
                      stopped: Optional[Callable[[], bool]] = None) -> Optional[str]:
    """`refuse`'s words without the exit: on the speaking rank, print `error: PROBLEM` for each
    problem (a node's first rank naming its node) and tell its node's silent ranks; on a silent
    rank, wait for that word. The text printed, or None on a silent rank."""
    voice = startup_voice(env)
    several = env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")) != "1"
    if voice is None:
        if several:
            await_refusal(env, stopped)
        return None
    text = "\n".join(f"error{voice}: {p}" for p in problems)
    print(text, file=sys.stderr, flush=True)
    if several:
        announce_refusal(env)
    return text


def folder_problems(flag: str, path: str,
                    what: str = "the checkpoint folder (a run's --save)") -> List[str]:
    """A flag that names a folder given a file, or a path that does not exist, said as such
    (`--load ckpt/model.pt is a file: give the checkpoint folder ...`); empty for a folder or
    an object-storage URL (s3://, checked where it is read)."""
    if "://" in path:
        return []
    if os.path.isfile(path):
        return [f"{flag} {path} is a file: give {what}"]
    if not os.path.isdir(path):
        return [f"{flag} {path}: no such folder"]
    return []


def startup_voice(env: Mapping[str, str]) -> Optional[str]:
    """How this rank reports a command line that cannot run, found before any process group
    exists (so no rank can ask another): '' for rank 0, which speaks for the job; None (silent)
    for the other ranks of its node, which check the same flags and see the same files; and
    for the first rank of every other node a prefix naming the node, since a file may be
    missing there only."""
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    if rank == "0":
        return ""
    node = _node(env)
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if node == "0" or local != "0":
        return None
    return f" (node {node}, {socket.gethostname()})"


def _launcher_store(env: Mapping[str, str], timeout_s: float):
    """A client of torchrun's own store (the one its ranks rendezvous through), or None when
    the launcher offers none (srun, a plain `python`, an older launcher)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return None
    import torch.distributed as dist  # only under torchrun: the tools need no torch to refuse

    try:
        return dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, ValueError, OSError):  # gone meanwhile
        return None


def _node(env: Mapping[str, str]) -> str:
    """This process's node: torchrun's GROUP_RANK, Slurm's SLURM_NODEID, or NODE_RANK."""
    return env.get("GROUP_RANK", env.get("SLURM_NODEID", env.get("NODE_RANK", "0")))


def _refusal_key(env: Mapping[str, str]) -> str:
    return f"{REFUSAL_KEY}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_node(env)}"


def announce_refusal(env: Mapping[str, str]) -> None:
    """A speaking rank has printed why the command line cannot run: tell its node's silent
    ranks through the launcher's store, so that they leave now."""
    store = _launcher_store(env, 5.0)
    if store is not None:
        try:
            store.set(_refusal_key(env), "printed")
        except (RuntimeError, OSError):  # the launcher is ending the job already
            pass


def await_refusal(env: Mapping[str, str], stopped: Optional[Callable[[], bool]] = None,
                  grace_s: float = SILENT_RANK_GRACE_S) -> None:
    """A silent rank outlives its speaking rank's message (a launcher ends the other ranks as
    soon as one exits, which could cut the message short): it waits until the speaker says it
    has printed (launcher_store), or `stopped()` says a stop signal came (torchrun ending the
    job; without `stopped`, SIGTERM's default action ends the wait), or grace_s passes."""
    deadline = time.monotonic() + grace_s
    store = _launcher_store(env, grace_s)
    if store is not None:
        try:
            store.wait([_refusal_key(env)],
                       timedelta(seconds=max(0.0, deadline - time.monotonic())))
            return
        except (RuntimeError, OSError):  # no word in time, or the store is gone
            pass
    while time.monotonic() < deadline and not (stopped is not None and stopped()):
        time.sleep(0.05)
