"""Command line: list covered primitives, find uncovered ones, explain a plan.

``python -m jaxshard rules`` lists the primitives the catalogue covers.
``python -m jaxshard missing examples/gpt.py:factory`` lists the primitives of a
function that have no rule. ``python -m jaxshard explain examples/gpt.py:factory
--mesh data=2,model=4 --hint 'batch/.*=data'`` prints the plan; ``verify`` compiles it
and reports every collective the plan did not predict (exit 1 on a surprise);
``report -o plan.html`` writes the HTML report. With ``--search`` (and optionally
``--memory-budget 2GiB``) the layouts the hints leave free are searched
(`jaxshard.search`) and ``explain`` prints the search's summary first. ``python -m
jaxshard strategy examples/gpt.py:factory --devices 1024 --memory 80GiB [--topology
h100:128] [--hint 'batch/.*=data']`` chooses the mesh and the parallelism for that many
devices (`jaxshard.auto_parallel`, planning only: no devices needed) and prints the
ranked candidates; its hints name the roles ``data``, ``fsdp``, ``tensor`` (the
factory's own hints are for its own mesh and are not used). A factory
returns ``(fn, args)`` or
``(fn, args, hints)``; args may be `jax.ShapeDtypeStruct`s. The mesh is made of the
default devices, or of simulated CPU devices when there are fewer than it needs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import re
import sys


def parse_spec(text: str):
    """A PartitionSpec from text: entries split by ``,``; ``None`` or ``-`` replicated,
    ``?`` unconstrained, ``a*b`` several axes. Text that is not a spec raises
    `argparse.ArgumentTypeError` saying what is wrong.

    Example:
        >>> parse_spec("None,model"), parse_spec("data*model,?")
        (P(None, 'model'), P(('data', 'model'), UNCONSTRAINED))
    """
    from jax.sharding import PartitionSpec as P

    entries = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            if text.strip():
                raise argparse.ArgumentTypeError(
                    f"spec {text!r} has an empty entry; write e.g. 'None,model' or 'data*model'"
                )
            continue
        if item in ("None", "-"):
            entries.append(None)
        elif item == "?":
            entries.append(P.UNCONSTRAINED)
        else:
            names = [n.strip() for n in item.split("*")]
            bad = [n for n in names if not _AXIS.fullmatch(n)]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"spec {text!r}: {bad[0]!r} is not a mesh axis name; entries are axis names, "
                    "'None' or '-' (replicated), '?' (left to the planner) or 'a*b' (several axes)"
                )
            entries.append(tuple(names) if len(names) > 1 else names[0])
    return P(*entries)


_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_hint(text: str) -> tuple[str, object]:
    """A ``--hint REGEX=SPEC`` argument: the regex (checked) and the spec (`parse_spec`).

    Example:
        >>> parse_hint("batch/.*=data")
        ('batch/.*', P('data',))
    """
    key, sep, spec = text.rpartition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"--hint {text!r} is not REGEX=SPEC; write e.g. 'batch/.*=data' or 'params/w=None,model'"
        )
    try:
        re.compile(key)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"--hint {text!r}: {key!r} is not a regex ({e})") from None
    return key, parse_spec(spec)


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A ``--mesh`` argument: axis names and sizes, ``data=2,model=4``.

    Example:
        >>> parse_mesh("data=2,model=4")
        (('data', 'model'), (2, 4))
    """
    names, sizes = [], []
    for item in text.split(","):
        name, sep, size = (t.strip() for t in item.partition("="))
        if not sep or not _AXIS.fullmatch(name) or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: {item.strip()!r} is not AXIS=SIZE with a positive size; "
                "write e.g. data=2,model=4"
            )
        if name in names:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: axis {name!r} appears twice")
        names.append(name)
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count from the command line: a number with an optional binary unit.

    Example:
        >>> parse_bytes("2GiB"), parse_bytes("512 MiB"), parse_bytes("1000")
        (2147483648, 536870912, 1000)
    """
    number = text.rstrip("KMGTiB ")
    unit = text[len(number) :].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive byte count; write e.g. 2GiB, 512MiB or 1000000"
        )
    return int(value)


def parse_topology(text: str):
    """A ``--topology`` argument: ``uniform``, ``h100:NODES`` or
    ``tpu:VERSION:CHIPS[:SLICES]``.

    Example:
        >>> parse_topology("h100:2").devices, parse_topology("tpu:v5p:256:2").devices
        (16, 512)
    """
    from jaxshard.errors import ShardingError
    from jaxshard.topology import Topology

    kind, *rest = text.split(":")
    try:
        if kind == "uniform" and not rest:
            return None
        if kind == "h100" and len(rest) == 1 and rest[0].isdigit():
            return Topology.h100(nodes=int(rest[0]))
        if kind == "tpu" and len(rest) in (2, 3) and all(r.isdigit() for r in rest[1:]):
            return Topology.tpu(rest[0], *map(int, rest[1:]))
    except ShardingError as e:
        raise argparse.ArgumentTypeError(f"--topology {text!r}: {e}") from None
    raise argparse.ArgumentTypeError(
        f"--topology {text!r}: write uniform, h100:NODES (e.g. h100:8) or "
        "tpu:VERSION:CHIPS[:SLICES] (e.g. tpu:v5p:1024)"
    )


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive device count")
    return int(text)


def strategy_command(args) -> int:
    """``jaxshard strategy``: `auto_parallel` for a device count; prints its explanation."""
    from jaxshard.errors import ShardingError
    from jaxshard.strategy import auto_parallel

    fn, fn_args, _ = load_factory(args.target)
    try:
        strategy = auto_parallel(
            fn, *fn_args, devices=args.devices, memory_per_device=args.memory,
            topology=args.topology, hints=dict(args.hint),
        )  # fmt: skip
    except ShardingError as e:
        print(f"jaxshard strategy: {e}", file=sys.stderr)
        return 2
    print(strategy.explain())
    return 0


def load_factory(target: str):
    """Call ``path/to/file.py:name`` or ``package.module:name`` and return its result.

    Example:
        >>> fn, args, hints = load_factory("examples/gpt.py:factory")  # doctest: +SKIP
    """
    where, _, name = target.rpartition(":")
    if not where or not name.isidentifier():
        raise SystemExit(f"jaxshard: expected FILE.py:FACTORY or MODULE:FACTORY, got {target!r}")
    if where.endswith(".py") or os.path.sep in where:
        if not os.path.isfile(where):
            raise SystemExit(f"jaxshard: {where}: no such file (from {target!r})")
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses in the file look their module up here
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise SystemExit(f"jaxshard: cannot import {where!r} (from {target!r}): {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SystemExit(
            f"jaxshard: {where} has no function {name!r}; its functions: {', '.join(found)}"
        )
    result = factory()
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise SystemExit(
            f"jaxshard: {target} returned a {type(result).__name__}; a factory returns "
            "(fn, args) or (fn, args, hints)"
        )
    fn, args, hints = (*result, {})[:3]
    if not callable(fn) or not isinstance(args, (tuple, list)) or not isinstance(hints, dict):
        raise SystemExit(
            f"jaxshard: {target} returned ({type(fn).__name__}, {type(args).__name__}, "
            f"{type(hints).__name__}); expected (a function, a tuple of arguments, a dict of "
            "hints)"
        )
    return fn, tuple(args), dict(hints)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m jaxshard`` and the ``jaxshard`` console script.

    Example:
        >>> main(["rules"])  # doctest: +ELLIPSIS
        abs
        ...
        0
    """
    parser = argparse.ArgumentParser(prog="jaxshard", description="jaxshard tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("rules", help="list the primitives that have sharding rules")
    for command, text in (
        ("missing", "list a function's primitives without a rule"),
        ("explain", "print a plan"),
        ("verify", "compile the plan and compare its collectives with the predictions"),
        ("report", "write the plan as a self-contained HTML page"),
    ):
        p = sub.add_parser(command, help=text)
        p.add_argument("target", help="MODULE:FACTORY returning (fn, args) or (fn, args, hints)")
        p.add_argument(
            "--mesh",
            type=parse_mesh,
            default=(("data", "model"), (2, 4)),
            help="axes and sizes, e.g. data=2,model=4",
        )
        p.add_argument(
            "--hint",
            type=parse_hint,
            action="append",
            default=[],
            help="REGEX=SPEC, e.g. 'batch/.*=data'",
        )
        if command != "missing":
            p.add_argument(
                "--search", action="store_true", help="search the layouts hints leave free"
            )
            p.add_argument(
                "--memory-budget",
                type=parse_bytes,
                help="per-device memory for --search, e.g. 2GiB or 512MiB",
            )
        if command == "report":
            p.add_argument(
                "-o", "--output", default="jaxshard-report.html", help="where to write the page"
            )
    p = sub.add_parser("strategy", help="choose the mesh and parallelism for a device count")
    p.add_argument("target", help="MODULE:FACTORY returning (fn, args) or (fn, args, hints)")
    p.add_argument("--devices", type=_positive_int, required=True, help="device count")
    p.add_argument("--memory", type=parse_bytes, required=True, help="per device, e.g. 80GiB")
    p.add_argument(
        "--topology", type=parse_topology, default=None,
        help="uniform (default), h100:NODES or tpu:VERSION:CHIPS[:SLICES]",
    )  # fmt: skip
    p.add_argument(
        "--hint", type=parse_hint, action="append", default=[],
        help="REGEX=SPEC naming roles data, fsdp, tensor, e.g. 'batch/.*=data'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "strategy":
        return strategy_command(args)
    if args.command == "rules":
        from jaxshard.rule import covered_primitives

        print("\n".join(covered_primitives()))
        return 0
    names, sizes = args.mesh
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={math.prod(sizes)}"
        )
    import jax

    from jaxshard.errors import ShardingError
    from jaxshard.graph import build_graph
    from jaxshard.plan import make_plan
    from jaxshard.trace import trace_on_mesh

    fn, fn_args, hints = load_factory(args.target)
    hints.update(args.hint)
    devices = jax.devices()
    if len(devices) < math.prod(sizes):  # e.g. one GPU: plan on the simulated CPU devices
        devices = jax.devices("cpu")
    if len(devices) < math.prod(sizes):
        parser.error(
            f"--mesh needs {math.prod(sizes)} devices and this process has {len(devices)}: "
            "use a smaller mesh, or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{math.prod(sizes)} before the first JAX import"
        )
    mesh = jax.make_mesh(sizes, names, devices=devices[: math.prod(sizes)])
    if args.command == "missing":
        graph = build_graph(trace_on_mesh(fn, fn_args, {}, mesh), dict(zip(names, sizes)))
        for prim, line in sorted(graph.unknown.items()):
            print(f"{prim}\t{line}")
        print(f"{len(graph.unknown)} primitive(s) without a rule", file=sys.stderr)
        return 0
    if args.memory_budget is not None and not args.search:
        parser.error("--memory-budget needs --search")
    summary = ""
    try:
        if args.search:
            from jaxshard.search import search_hints

            result = search_hints(fn, fn_args, {}, mesh, hints, memory_budget=args.memory_budget)
            plan, summary = result.plan, result.explanation + "\n\n"
        else:
            plan = make_plan(fn, fn_args, {}, mesh, hints)
    except ShardingError as e:  # bad hints or an impossible budget: the message is the fix
        print(f"jaxshard {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "verify":
        result = plan.verify()
        print(result)
        return 0 if result.ok else 1
    if args.command == "report":
        from jaxshard.report import write_report

        write_report(plan, args.output, title=args.target)
        print(args.output)
        return 0
    print(summary + plan.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
