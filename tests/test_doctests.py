"""Every docstring example in the engine and the catalogue runs and prints what it says, and
the documents cite only files that ship in the repository."""

import doctest
import importlib
import pkgutil

import jaxshard.rules
import pytest

import jaxshard

MODULES = sorted(
    [f"jaxshard.{m.name}" for m in pkgutil.iter_modules(jaxshard.__path__)]
    + [f"jaxshard.rules.{m.name}" for m in pkgutil.iter_modules(jaxshard.rules.__path__)]
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_documents_cite_only_files_in_the_repository():
    # a citation of a file outside the repository (a sibling checkout) dangles for users
    import pathlib
    import re
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml"], cwd=root, capture_output=True, text=True
    ).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    dangling = []
    for name in files:
        path = root / name
        for cited in re.findall(r"(?:\.\./)+[\w./-]+\.(?:md|py|txt)", path.read_text()):
            target = (path.parent / cited).resolve()
            if not target.is_relative_to(root) or not target.exists():
                dangling.append(f"{name}: {cited}")
    assert dangling == []
