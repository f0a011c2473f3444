"""Every docstring example in the engine and the catalogue runs and prints what it says, and
the documents cite only files that ship in the repository."""

import doctest
import importlib
import pkgutil

import jaxshard.rules
import pytest

import jaxshard

MODULES = sorted(
    [m.name for m in pkgutil.walk_packages(jaxshard.__path__, "jaxshard.")]
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


def test_engine_imports_form_no_circle():
    # each stage imports only stages below it, function-level imports included
    import ast
    import pathlib

    root = pathlib.Path(jaxshard.__file__).parent
    files = {  # the engine's modules, a package's modules named by the package
        ".".join(p.relative_to(root).with_suffix("").parts): p for p in root.glob("*.py")
    } | {p.parent.name + "." + p.stem: p for p in root.glob("*/*.py")}  # each subpackage
    files = {n.removesuffix(".__init__"): p for n, p in files.items() if n != "__init__"}
    modules = set(files) - {"__main__"}
    edges = {}
    for name in modules:
        targets = set()
        for node in ast.walk(ast.parse(files[name].read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        edges[name] = {t.removeprefix("jaxshard.") for t in targets} & (modules - {name})

    def cycle_from(name, path):
        if name in path:
            return path[path.index(name) :] + [name]
        for nxt in sorted(edges[name]):
            found = cycle_from(nxt, [*path, name])
            if found:
                return found
        return None

    circles = [c for c in (cycle_from(m, []) for m in sorted(modules)) if c]
    assert circles == [], " -> ".join(circles[0])
