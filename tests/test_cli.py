"""The command line, and planning across a primitive that has no rule."""

import argparse
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
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.__main__ import load_factory, main, parse_bytes, parse_hint, parse_mesh, parse_spec

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
    assert "--memory-budget needs --search" in err and "'lots' is not a positive byte count" in err


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


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(
            ["--mesh", "data=2,model"], r"'model' is not AXIS=SIZE", id="mesh-size-missing"
        ),
        pytest.param(
            ["--mesh", "data=0"],
            r"'data=0' is not AXIS=SIZE with a positive size",
            id="mesh-size-0",
        ),
        pytest.param(["--mesh", "data=two"], r"'data=two' is not AXIS=SIZE", id="mesh-size-word"),
        pytest.param(
            ["--mesh", "data=2,data=4"], r"axis 'data' appears twice", id="mesh-axis-twice"
        ),
        pytest.param(
            ["--mesh", "data=64"],
            r"--mesh needs 64 devices and this process has 8",
            id="mesh-too-big",
        ),
        pytest.param(["--hint", "batch"], r"--hint 'batch' is not REGEX=SPEC", id="hint-no-equals"),
        pytest.param(["--hint", "=data"], r"--hint '=data' is not REGEX=SPEC", id="hint-no-regex"),
        pytest.param(["--hint", "batch/(=data"], r"'batch/\(' is not a regex", id="hint-bad-regex"),
        pytest.param(
            ["--hint", "x=data**model"], r"'' is not a mesh axis name", id="hint-empty-axis"
        ),
        pytest.param(["--hint", "x=data,,model"], r"has an empty entry", id="hint-empty-entry"),
        pytest.param(
            ["--search", "--memory-budget=-1GiB"],
            r"not a positive byte count",
            id="negative-budget",
        ),
        pytest.param(
            ["--search", "--memory-budget", "nanMiB"], r"not a positive byte count", id="nan-budget"
        ),
    ],
)
def test_bad_command_line_arguments_exit_2_saying_the_fix(capsys, argv, message):
    target = os.path.join(ROOT, "examples", "mlp.py:factory")
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", target, *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _factory_file(tmp_path, body: str) -> str:
    path = tmp_path / "factory_file.py"
    path.write_text("import jax.numpy as jnp\n" + body)
    return str(path)


_RETURNS = "def factory():\n    return {}\n"


@pytest.mark.parametrize(
    "target, body, message",
    [
        pytest.param("missing.py:factory", None, r"missing.py: no such file", id="no-file"),
        pytest.param(
            "no_such_module_xyz:factory",
            None,
            r"cannot import 'no_such_module_xyz'",
            id="no-module",
        ),
        pytest.param(
            "FILE:nothing",
            _RETURNS.format("None"),
            r"has no function 'nothing'; its functions: factory",
            id="no-function",
        ),
        pytest.param(
            "FILE:factory",
            _RETURNS.format("3"),
            r"returned a int; a factory returns \(fn, args\)",
            id="not-a-tuple",
        ),
        pytest.param(
            "FILE:factory", _RETURNS.format("(jnp.sin,)"), r"returned a tuple", id="one-element"
        ),
        pytest.param(
            "FILE:factory",
            _RETURNS.format("(jnp.sin, 3, {})"),
            r"expected \(a function, a tuple",
            id="args-not-a-tuple",
        ),
        pytest.param("FILE", None, r"expected FILE.py:FACTORY", id="no-colon"),
    ],
)
def test_bad_factory_targets_say_what_is_wrong(tmp_path, target, body, message):
    if body is not None:
        target = target.replace("FILE", _factory_file(tmp_path, body))
    with pytest.raises(SystemExit, match=message):
        load_factory(target)


_TEXT = st.text(alphabet="ab=,*?-N one.()/0123456789", max_size=16)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=_TEXT)
def test_command_line_parsers_accept_or_explain_any_text(text):
    for parse in (parse_spec, parse_mesh, parse_hint, parse_bytes):
        try:
            parse(text)
        except argparse.ArgumentTypeError as e:
            assert repr(text) in str(e) or repr(text.strip()) in str(e) or "spec" in str(e)


def test_strategy_command_plans_for_a_device_count(capsys):
    assert main(["strategy", "examples/gpt.py:factory", "--devices", "16", "--memory", "1GiB",
                 "--topology", "h100:2", "--hint", "batch/.*=data"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "auto_parallel: 16 devices" in out and "winner:" in out and "NVLink" in out


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--topology", "h100"], "write uniform, h100:NODES"),
        (["--topology", "tpu:v9:8"], "known versions"),
        (["--devices", "0"], "not a positive device count"),
    ],
    ids=["topology-form", "tpu-version", "devices"],
)
def test_strategy_command_rejects_bad_options(capsys, argv, error):
    base = {"--devices": "16", "--memory": "1GiB"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit):
        main(["strategy", "examples/gpt.py:factory", *[x for kv in base.items() for x in kv]])
    assert error in capsys.readouterr().err
