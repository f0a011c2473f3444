"""What every benchmark table says about where it was measured, and where it is written:
the commit, JAX and Python versions, cores and load (`environment`, `load_now`), and
`write_result` for ``benchmarks/results/``. JAX is imported only when asked for, so a
benchmark can import this module before it sets its simulated device count."""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def environment() -> str:
    """One sentence: when, at which commit, on which JAX, Python, cores and devices.

    Example:
        >>> environment()  # doctest: +SKIP
        'Measured 2026-11-25 07:20 at commit e2f3332: JAX 0.10.2, Python 3.11.9, ...'
    """
    import jax

    try:
        git = functools.partial(subprocess.run, cwd=HERE, capture_output=True, text=True)
        commit = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        if git(["git", "status", "--porcelain", "--", "../jaxshard", "../rules"]).stdout.strip():
            commit += " (with uncommitted changes to jaxshard/ or rules/)"
    except OSError:
        commit = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    platform_name = jax.devices()[0].platform
    return (
        f"Measured {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} at commit {commit}: "
        f"JAX {jax.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores "
        f"(load average {load:.1f} at start), {jax.device_count()} "
        f"{'simulated ' if platform_name == 'cpu' else ''}{platform_name.upper()} "
        f"device{'s' if jax.device_count() > 1 else ''}."
    )


def require(module: str, why: str) -> None:
    """Stop before any work when an optional dependency of a benchmark is missing: found
    missing at the end, it would cost the whole run's results.

    Example:
        >>> require("numpy", "tables")
    """
    if importlib.util.find_spec(module) is None:
        raise SystemExit(
            f'{module} is needed for {why}: pip install -e ".[bench]" (the benchmarks\' extra)'
        )


def load_now() -> str:
    """The load average as a sentence, for the end of a run.

    Example:
        >>> load_now()  # doctest: +SKIP
        'Load average when this file was written: 1.9.'
    """
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"Load average when this file was written: {load:.1f}."


def write_result(name: str, text: str, quick: bool) -> None:
    """Write ``results/[quick/]<name>.md`` and print it.

    Example:
        >>> write_result("scale", "# Real sizes", quick=True)  # doctest: +SKIP
    """
    out = os.path.join(HERE, "results", "quick" if quick else "")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines, columns padded to their widest cell.

    Example:
        >>> markdown_table(["a", "bb"], [["1", "2"]])
        ['| a | bb |', '|---|----|', '| 1 | 2  |']
    """
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
