"""The tasks' `custom_dataset`: their `dataset_kwargs.data_files` read relative to this folder.

lm_eval hands `dataset_kwargs` to `datasets.load_dataset("json", ...)`, which reads a relative
`data_files` path against the working directory, so a task folder would only work from the
folder it was written for. A YAML's `!function` is resolved next to the YAML, from any working
directory: `custom_dataset: !function local_files.load_json` makes lm_eval call this function
with `dataset_kwargs` (and the run's metadata, ignored here) instead.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_json(data_files, **_metadata):
    """`datasets.load_dataset("json", data_files=...)` with each relative path taken against
    this folder; data_files as the datasets library takes it (a path, a list, or a dict from
    split name to either)."""
    import datasets

    def resolve(paths):
        if isinstance(paths, (list, tuple)):
            return [resolve(p) for p in paths]
        return str(HERE / paths)  # (an absolute path stays itself)

    if isinstance(data_files, dict):
        data_files = {split: resolve(paths) for split, paths in data_files.items()}
    else:
        data_files = resolve(data_files)
    return datasets.load_dataset("json", data_files=data_files)
