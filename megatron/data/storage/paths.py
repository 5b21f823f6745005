"""Paths with a URL scheme (`s3://bucket/key`) on flags that take a local path.

Python's `open` and `pathlib` take `s3://ckpt/run` for the local folder `s3:/ckpt/run`: a run
given `--save s3://ckpt/run` would write there, exit 0, and leave nothing on the server. Every
path flag of the entry points and of data_tools/ is checked here, before anything starts,
against the schemes it reads or writes (`s3://` for data prefixes; none for the others).
"""

from __future__ import annotations

import re
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(path: object) -> Optional[str]:
    """'s3' for 's3://bucket/key'; None for a local path (or a value that is not a string)."""
    if not isinstance(path, str):
        return None
    found = _SCHEME.match(path)
    return found.group(1).lower() if found else None


def scheme_problems(flag: str, paths: Union[None, str, Sequence[object]],
                    supported: Iterable[str] = ()) -> List[str]:
    """One message per value of `flag` (a path or a list of them; None: not given) whose
    scheme `flag` does not support (`supported`: e.g. ('s3',); empty: local paths only)."""
    if paths is None:
        return []
    supported = tuple(supported)
    values = [paths] if isinstance(paths, str) else list(paths)
    problems = []
    for path in values:
        scheme = scheme_of(path)
        if scheme is None or scheme in supported:
            continue
        takes = "a local path (or a mounted file system's)"
        if supported:
            takes += " or " + ", ".join(f"{s}://" for s in supported)
        problems.append(f"{flag} {path}: {flag} takes {takes}, not a {scheme}:// URL (it would "
                        f"be read as the local path {path.replace('://', ':/', 1)!r}); give a "
                        f"local path")
    return problems


def path_flag_problems(values: Mapping[str, object],
                       flags: Mapping[str, Tuple[str, Iterable[str]]]) -> List[str]:
    """scheme_problems for every destination in `flags` (dest -> (the flag's name, its
    supported schemes)) that `values` (`vars(namespace)`) holds."""
    problems = []
    for dest, (flag, supported) in flags.items():
        problems += scheme_problems(flag, values.get(dest), supported)
    return problems
