"""The installed package stands on its declared dependencies alone.

Each check runs in a fresh interpreter (a subprocess), so nothing another test imported can
hide a missing module: every module of ``jaxshard`` and ``jaxshard.rules`` imports, every
third-party module the package imports is declared in ``pyproject.toml`` (or is an optional
integration imported only once the user has imported it, checked by running without it), and
the search (HiGHS) and the console script work end to end.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import jaxshard

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = (
    pathlib.Path(jaxshard.__file__).parent,
    pathlib.Path(jaxshard.rules.__file__).parent,
)

# Integrations the package supports without depending on them: each is imported inside a
# function, only once the user's program has imported it (``"flax" in sys.modules``), and
# ``test_runs_without_optional_integrations`` plans a program with all of them unimportable.
OPTIONAL = {"flax", "equinox"}


def _run(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in
            project["dependencies"]}  # fmt: skip


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_imports_in_a_fresh_interpreter():
    code = (
        "import importlib, pkgutil, jaxshard, jaxshard.rules\n"
        "names = [m.name for p in (jaxshard, jaxshard.rules)\n"
        "         for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names))\n"
    )
    count = int(_run(code).stdout.split()[-1])
    assert count >= 25, count  # the engine's stages and the rule families


def test_every_third_party_import_is_declared():
    declared = _declared()
    assert "highspy" in declared, "the search's solver must be a core dependency"
    undeclared = {}
    for folder in PACKAGE_DIRS:
        for source in folder.rglob("*.py"):
            for name in _imports(ast.parse(source.read_text())):
                if name in sys.stdlib_module_names or name in ("jaxshard", "rules"):
                    continue
                if name.lower() not in declared and name not in OPTIONAL:
                    undeclared.setdefault(name, []).append(source.name)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def _import_time_imports(tree: ast.AST) -> set[str]:
    """The imports that run when the module is imported: not those inside functions."""
    names, todo = set(), [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= _imports(node)
        todo.extend(ast.iter_child_nodes(node))
    return names


def test_optional_integrations_are_not_imported_at_module_level():
    for folder in PACKAGE_DIRS:
        for source in folder.rglob("*.py"):
            found = _import_time_imports(ast.parse(source.read_text())) & OPTIONAL
            assert not found, f"{source.name} imports {found} at module level: import it lazily"


def test_runs_without_optional_integrations():
    """Planning and running a step works where flax and equinox cannot be imported."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(OPTIONAL)!r}:\n"
        "            raise ImportError(f'{name} blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import PartitionSpec as P\n"
        "import jaxshard\n"
        "mesh = jax.make_mesh((2, 4), ('data', 'model'))\n"
        "f = lambda w, x: jnp.tanh(x @ w).sum()\n"
        "step = jaxshard.auto_shard(mesh, {'x': P('data'), 'w': P(None, 'model')})(f)\n"
        "w, x = jnp.ones((16, 32)), jnp.ones((8, 16))\n"
        "print(float(step(w, x)), float(f(w, x)))\n"
    )
    sharded, plain = map(float, _run(code).stdout.split())
    assert abs(sharded - plain) <= 1e-5 * abs(plain)


def test_search_runs_in_a_fresh_interpreter():
    code = (
        "import sys\n"
        "sys.path.insert(0, 'examples')\n"
        "import jax, mlp, jaxshard\n"
        "step, args, hints = mlp.factory()\n"
        "mesh = jax.make_mesh((2, 4), ('data', 'model'))\n"
        "auto = jaxshard.auto_shard(mesh, {'batch/.*': hints['batch/.*']}, search=True)(step)\n"
        "plan = auto.plan(*args)\n"
        "print(auto.search_result.optimal)\n"
    )
    assert _run(code).stdout.split()[-1] == "True"


def test_console_script_runs_the_search():
    script = pathlib.Path(sys.executable).parent / "jaxshard"
    script = str(script) if script.exists() else shutil.which("jaxshard")
    assert script, "the jaxshard console script is not installed: pip install -e ."
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    target = "examples/mlp.py:factory"
    done = subprocess.run(
        [script, "explain", target, "--mesh", "data=2,model=4", "--hint", "batch/.*=data",
         "--search"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("search: ") and "params/layers/1/w" in done.stdout


def test_every_package_folder_is_packaged():
    """A folder missing from ``[tool.setuptools] packages`` is left out of a wheel (an
    editable install still finds it, so only a non-editable install would fail)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])  # fmt: skip
    found = {"jaxshard.rules"} | {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "jaxshard").rglob("__init__.py")
    }
    assert found <= listed, f"add to pyproject.toml's packages: {sorted(found - listed)}"
