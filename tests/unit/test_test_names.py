"""pytest imports test files by their base name (rootdir mode): two with one name in
different folders stop the whole collection. Every test file's name is its own."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert [name for name, n in names.items() if n > 1 and name != "__init__.py"] == []
