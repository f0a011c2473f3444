"""The command line, and planning across a primitive that has no rule."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.__main__ import main, parse_spec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def uncovered_factory():
    """A function with a primitive the catalogue does not cover (a host callback)."""

    def f(a, x):
        spd = a @ a.T + 4 * jnp.eye(4)
        chol = jax.pure_callback(np.linalg.cholesky, jax.ShapeDtypeStruct((4, 4), jnp.float32), spd)
        return chol @ x

    return f, (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32))


def test_rules_lists_covered_primitives(capsys):
    assert main(["rules"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"dot_general", "reshape", "scan", "gather", "scatter-add"} <= set(listed)


def test_missing_reports_uncovered_primitives(capsys):
    with pytest.warns(jaxshard.JaxshardWarning):
        assert main(["missing", os.path.join(HERE, "test_cli.py:uncovered_factory")]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("pure_callback\t") and "test_cli.py" in out.out
    assert "1 primitive(s) without a rule" in out.err


def test_missing_on_the_gpt_example_finds_none(capsys):
    assert main(["missing", os.path.join(ROOT, "examples", "gpt.py:factory")]) == 0
    assert "0 primitive(s) without a rule" in capsys.readouterr().err


def test_explain_prints_the_plan(capsys):
    target = os.path.join(ROOT, "examples", "mlp.py:factory")
    assert main(["explain", target, "--mesh", "data=2,model=4", "--hint", "batch/.*=data"]) == 0
    out = capsys.readouterr().out
    assert "params/layers/1/w" in out and "P('model',)" in out


def test_explain_with_search_prints_its_summary(capsys):
    target = os.path.join(ROOT, "examples", "mlp.py:factory")
    assert main(["explain", target, "--hint", "batch/.*=data", "--search"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("search: ") and "optimal" in out and "params/layers/1/w" in out


def test_search_over_budget_exits_2_naming_the_smallest_footprint(capsys):
    target = os.path.join(ROOT, "examples", "mlp.py:factory")
    argv = ["explain", target, "--hint", "batch/.*=data", "--search", "--memory-budget", "1KiB"]
    assert main(argv) == 2
    assert re.search(r"smallest footprint .* is [\d.]+ KiB", capsys.readouterr().err)


def test_memory_budget_needs_search_and_a_byte_count(capsys):
    target = os.path.join(ROOT, "examples", "mlp.py:factory")
    for extra in (["--memory-budget", "1GiB"], ["--search", "--memory-budget", "lots"]):
        with pytest.raises(SystemExit):
            main(["explain", target, *extra])
    err = capsys.readouterr().err
    assert "--memory-budget needs --search" in err and "'lots' is not a byte count" in err


def test_unknown_primitive_warns_once_and_is_a_boundary(mesh):
    f, args = uncovered_factory()
    with pytest.warns(
        jaxshard.JaxshardWarning,
        match=r"no sharding rule for: pure_callback \(first at .*test_cli.py.*: its results "
        r"\(a float32\[4, 4\] value; 64 bytes\) get no sharding from its operands",
    ):
        plan = jaxshard.make_plan(f, args, {}, mesh, {"x": P(None, "model")})
    assert plan.in_specs == (P(), P(None, "model"))
    assert plan.out_specs == P(None, "model")


@pytest.mark.parametrize(
    "text, spec",
    [
        ("data", P("data")),
        ("None,model", P(None, "model")),
        ("data*model,?", P(("data", "model"), P.UNCONSTRAINED)),
    ],
)
def test_parse_spec(text, spec):
    assert parse_spec(text) == spec


def test_verify_and_report_commands(capsys, tmp_path):
    target = os.path.join(ROOT, "examples", "mlp.py:factory")
    assert main(["verify", target]) == 0
    assert "as planned" in capsys.readouterr().out
    page = tmp_path / "plan.html"
    assert main(["report", target, "-o", str(page)]) == 0
    assert "params/layers/0/w" in page.read_text()


def test_the_readme_explain_command_works_as_documented():
    """The README's ``jaxshard explain examples/gpt.py:factory --mesh ... --hint ...`` line,
    run by the installed console script from the repository root in a clean environment."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (line,) = re.findall(r"^jaxshard explain examples/gpt\.py:factory --mesh .*$", readme, re.M)
    assert "--hint" in line
    script = os.path.join(os.path.dirname(sys.executable), "jaxshard")
    script = script if os.path.exists(script) else shutil.which("jaxshard")
    assert script, "the jaxshard console script is not installed: pip install -e ."
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run(
        [script, *shlex.split(line)[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.startswith("jaxshard plan on mesh (data=2 x model=4)")
    assert re.search(r"^params/layers/0/attn/wq .* P\(None, 'model'\) ", out, re.M)
    assert "all-reduce over model" in out and "predicted communication:" in out
