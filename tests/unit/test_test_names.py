"""Test modules are imported by their basename (the test folders have no __init__.py and put
themselves on sys.path), so two test files or two helper modules of the same name in different
folders break the collection of the whole suite ("import file mismatch"). Each name once."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_and_helper_module_name_is_unique():
    names = Counter(path.name for path in TESTS.rglob("*.py")
                    if "data" not in path.relative_to(TESTS).parts[:1]
                    and path.name not in ("conftest.py", "__init__.py"))
    assert [name for name, count in names.items() if count > 1] == []
