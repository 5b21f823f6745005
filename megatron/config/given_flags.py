"""Which flags a command line gave, and under which spelling: what "a flag that changes
nothing is refused" and "two spellings of one flag that disagree are refused" need.

A flag's value alone cannot say whether it was given where its default is a meaningful value
(`--prompt-length 100`, `--max-ngram 10`), and an alias (`--batch-size` for
`--micro-batch-size`) writes the same destination, so argparse keeps the last silently.
`record_given(parser)` makes every action of a parser also note (destination, spelling,
value) in the namespace it fills, under GIVEN; `given_flags(values)` reads that back.
"""

from __future__ import annotations

import argparse
import functools
from typing import Dict, List, Mapping, Optional, Set, Tuple

GIVEN = "given_flags"
"""The namespace attribute: a tuple of (dest, option string, value after the action, the
value as written), in command-line order (a tuple, so that the parser's default is never
shared mutable state)."""


@functools.lru_cache(maxsize=None)
def _recording(cls: type) -> type:
    """A subclass of the action class `cls` that also records each use."""

    def __call__(self, parser, namespace, values, option_string=None):
        cls.__call__(self, parser, namespace, values, option_string)
        shown = "" if self.nargs == 0 else _shown(values)  # a switch: its spelling says all
        entry = (self.dest, option_string or self.dest, getattr(namespace, self.dest, None),
                 shown)
        setattr(namespace, GIVEN, tuple(getattr(namespace, GIVEN, ())) + (entry,))

    return type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})


def record_given(parser: argparse.ArgumentParser) -> None:
    """Make every flag of `parser` record its uses in the namespace (GIVEN)."""
    parser.set_defaults(**{GIVEN: ()})
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        action.__class__ = _recording(type(action))


def uses(values: Mapping[str, object]) -> Optional[Tuple[Tuple[str, str, object, str], ...]]:
    """The recorded uses (None: the namespace came from a parser that does not record)."""
    found = values.get(GIVEN)
    return None if found is None else tuple(found)


def given_dests(values: Mapping[str, object], defaults: Mapping[str, object]) -> Set[str]:
    """The destinations the command line set. Without a record (a namespace made another way),
    those whose value differs from `defaults` (the parser's)."""
    recorded = uses(values)
    if recorded is not None:
        return {use[0] for use in recorded}
    return {dest for dest, default in defaults.items()
            if dest in values and values[dest] != default}


def spellings(values: Mapping[str, object]) -> Dict[str, str]:
    """dest -> the option string the command line set it with last (for messages)."""
    return {use[0]: use[1] for use in uses(values) or ()}


def alias_problems(values: Mapping[str, object]) -> List[str]:
    """Two spellings of one setting given with different values (`--batch-size 2
    --micro-batch-size 4`): argparse would keep the last silently. The same spelling repeated
    is an override (a script's flags, then the user's) and is not refused."""
    by_dest: Dict[str, Dict[str, Tuple[object, str]]] = {}
    for dest, option, value, shown in uses(values) or ():
        by_dest.setdefault(dest, {})[option] = (value, shown)  # each spelling's last
    problems = []
    for dest, last in by_dest.items():
        if len(last) > 1 and len({repr(v) for v, _ in last.values()}) > 1:
            both = " and ".join(f"{option} {shown}".rstrip()
                                for option, (_, shown) in last.items())
            problems.append(f"{both} set the same thing ({dest}) to different values: give "
                            f"one of them")
    return problems


def _shown(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)
