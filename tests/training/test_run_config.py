"""The run configuration is typed and frozen, validation never writes onto the parsed flags, and
the package's import structure keeps its floors: no cycles, every import runs down the layers
(LAYERS), and the training loop loads no DeepSpeed."""

import ast
import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.arguments import build_parser, validate
from megatron.config import RunConfig
from train_workers import base_argv

REPO = Path(__file__).resolve().parents[2]


def test_validation_reads_the_flags_and_returns_frozen_parts(train_data, tmp_path):
    args = build_parser().parse_args(base_argv(train_data, "--bf16", "--zero-stage", "1",
                                               "--save", str(tmp_path / "ckpt")))
    before = copy.deepcopy(vars(args))
    config, problems = validate(args, {"WORLD_SIZE": "2"})
    assert problems == []
    assert vars(args) == before  # nothing resolved onto the namespace
    assert isinstance(config, RunConfig)
    for part in dataclasses.fields(config):
        value = getattr(config, part.name)
        if dataclasses.is_dataclass(value):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(value, dataclasses.fields(value)[0].name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch = None
    # resolved values are in the parts (and, as plain JSON, in the flags for meta.json)
    assert (config.parallel.data_parallel_size, config.batch.gradient_accumulation_steps) == (2, 1)
    assert config.flags["gradient_accumulation_steps"] == 1 and config.flags["precision"] == "bf16"
    assert config.flags["micro_batch_size"] == config.batch.micro_batch_size == 2
    # the DeepSpeed JSON is handed out as a copy
    config.deepspeed_json()["zero_optimization"]["stage"] = 3
    assert config.deepspeed["zero_optimization"]["stage"] == 1


def test_a_bad_command_line_gives_no_config(train_data):
    args = build_parser().parse_args(base_argv(train_data, "--micro-batch-size", "3"))
    config, problems = validate(args, {})
    assert config is None and any("--global-batch-size 4" in p for p in problems)


def _module_imports(path: Path):
    """megatron modules a file imports, at module level or inside functions (an import inside
    a function is a dependency too); `if TYPE_CHECKING:` blocks import nothing at run time."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron"):
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("megatron"))


def _graph():
    graph = {}
    for path in (REPO / "megatron").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        graph[name.removesuffix(".__init__")] = set(_module_imports(path))
    return graph


def test_no_module_cycles_and_two_readers_of_the_command_line():
    graph = _graph()

    def reaches(start, target, seen):
        for dep in graph.get(start, ()):
            if dep == target or (dep not in seen and not seen.add(dep)
                                 and reaches(dep, target, seen)):
                return True
        return False

    cycles = [m for m in graph if reaches(m, m, set())]
    assert cycles == []
    # the command line is read by the trainer, and by the planner, which resolves each
    # candidate layout's flags through the trainer's own checks
    users = sorted(m for m, deps in graph.items() if "megatron.arguments" in deps)
    assert users == ["megatron.plan.search", "megatron.pretrain_t5"]


SCANNED = ("megatron", "data_tools", "bench")
"""The folders whose files may not import each other in a circle."""


def _file_of(module: str):
    """The repository file of a dotted module name (a module or a package's __init__.py)."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_files(path: Path):
    """The repository files `path` imports: at module level or inside a function, relative
    imports resolved, `from package import module` taken as the module's file;
    `if TYPE_CHECKING:` blocks import nothing at run time."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = path.relative_to(REPO).parent.parts
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found = (_file_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *(node.module or "").split("."))).strip(".")
            found = [_file_of(f"{module}.{alias.name}") or _file_of(module)
                     for alias in node.names]
        else:
            continue
        yield from (f for f in found if f is not None and f != path)


def _circles(graph):
    """The strongly connected components of more than one file (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _file_graph():
    """Each file of megatron/, data_tools/ and bench/ (a repository path) with the repository
    files it imports."""
    return {str(path.relative_to(REPO)): {str(f.relative_to(REPO)) for f in _imported_files(path)}
            for folder in SCANNED for path in sorted((REPO / folder).rglob("*.py"))}


def test_no_import_circle_between_files():
    """No two files of megatron/, data_tools/ or bench/ import each other, directly or through
    others (an import inside a function counts: it runs too)."""
    circles = _circles(_file_graph())
    assert not circles, "import circles between files:\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_a_circle_is_found_and_named():
    graph = {"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"},
             "e.py": set()}
    assert _circles(graph) == [["a.py", "b.py", "c.py"]]


LAYERS = (
    ("megatron/data/",),  # knows no model and no torch.distributed
    ("megatron/cli.py", "megatron/stdout.py", "megatron/failures.py", "megatron/parallel_state.py"),
    ("megatron/tensor_parallel/",),
    ("megatron/model/",),  # knows no DeepSpeed
    ("megatron/pipeline/",),
    ("megatron/config/",),  # reads no file
    ("megatron/deepspeed_internals.py",),  # used by checkpoint/ (ZeRO-3 gathers) and training/
    ("megatron/checkpoint/",),
    ("megatron/cost/", "megatron/plot/"),
    ("megatron/generation/",),
    ("megatron/evaluation/",),  # lm-evaluation-harness's LM over our model; task metrics
    ("megatron/training/",),
    # validation: arguments.py reads config/ and the checkpoints a run loads (checkpoint/), and
    # builds the DeepSpeed config (training/ds_config.py)
    ("megatron/initialize.py", "megatron/arguments.py"),
    ("megatron/loaded_model.py",),  # the model a command runs, from a checkpoint
    ("megatron/pretrain_t5.py", "megatron/pretrain_enc_dec.py", "megatron/generate.py",
     "megatron/evaluate.py",
     "megatron/torchrun.py", "megatron/plan/"),  # the entry points
    ("data_tools/",),
    ("bench/",),
)
"""The layers of megatron/, data_tools/ and bench/, from the ground up: a file imports files of
its own layer or of those below it, never of one above."""


def _layer(path: str):
    """The index in LAYERS of a file's layer (None: in none)."""
    for i, layer in enumerate(LAYERS):
        if any(path == place or path.startswith(place) for place in layer):
            return i
    return None


def _upward_imports(graph):
    """(importer, imported) for each import of a file from a layer above its own."""
    return sorted((path, dep) for path, deps in graph.items() for dep in deps
                  if _layer(dep) > _layer(path))


def test_every_import_runs_down_the_layers():
    """No file imports one of a higher layer (an import inside a function counts: it runs too);
    every file has its place in LAYERS."""
    graph = _file_graph()
    unplaced = sorted(path for path in graph if _layer(path) is None)
    assert not unplaced, "files in no layer (give each its place in LAYERS):\n" + \
        "\n".join(unplaced)
    upward = _upward_imports(graph)
    assert not upward, "imports from a lower layer to a higher one (move what is imported " \
        "down, or the import up):\n" + "\n".join(f"{a} -> {b}" for a, b in upward)


def test_an_upward_import_is_found_and_named():
    graph = {"megatron/checkpoint/formats/weights.py": {"megatron/training/step.py",
                                                        "megatron/model/meta.py"},
             "megatron/training/step.py": {"megatron/checkpoint/formats/weights.py"},
             "megatron/training/loop.py": {"megatron/training/step.py"}}
    assert _upward_imports(graph) == [("megatron/checkpoint/formats/weights.py",
                                       "megatron/training/step.py")]


def test_the_loop_loads_no_deepspeed():
    code = ("import sys, megatron.training.loop; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ), check=True).stdout
    assert out.strip() == "[]"
