"""Command line: list covered primitives, find uncovered ones, explain a plan.

``python -m jaxshard rules`` lists the primitives the catalogue covers.
``python -m jaxshard missing examples/gpt.py:factory`` lists the primitives of a
function that have no rule. ``python -m jaxshard explain examples/gpt.py:factory
--mesh data=2,model=4 --hint 'batch/.*=data'`` prints the plan; ``verify`` compiles it
and reports every collective the plan did not predict (exit 1 on a surprise);
``report -o plan.html`` writes the HTML report. With ``--search`` (and optionally
``--memory-budget 2GiB``) the layouts the hints leave free are searched
(`jaxshard.search`) and ``explain`` prints the search's summary first. A factory
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
import sys


def parse_spec(text: str):
    """A PartitionSpec from text: entries split by ``,``; ``None`` or ``-`` replicated,
    ``?`` unconstrained, ``a*b`` several axes.

    Example:
        >>> parse_spec("None,model"), parse_spec("data*model,?")
        (P(None, 'model'), P(('data', 'model'), UNCONSTRAINED))
    """
    from jax.sharding import PartitionSpec as P

    entries = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item in ("None", "-"):
            entries.append(None)
        elif item == "?":
            entries.append(P.UNCONSTRAINED)
        elif "*" in item:
            entries.append(tuple(item.split("*")))
        else:
            entries.append(item)
    return P(*entries)


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
        return int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count; write e.g. 2GiB, 512MiB or 1000000"
        ) from None


def load_factory(target: str):
    """Call ``path/to/file.py:name`` or ``package.module:name`` and return its result.

    Example:
        >>> fn, args, hints = load_factory("examples/gpt.py:factory")  # doctest: +SKIP
    """
    where, _, name = target.rpartition(":")
    if not where:
        raise SystemExit(f"jaxshard: expected MODULE:FACTORY, got {target!r}")
    if where.endswith(".py") or os.path.sep in where:
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses in the file look their module up here
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    result = getattr(module, name)()
    fn, args, hints = (*result, {})[:3] if len(result) == 2 else result
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
            "--mesh", default="data=2,model=4", help="axes and sizes, e.g. data=2,model=4"
        )
        p.add_argument(
            "--hint", action="append", default=[], help="REGEX=SPEC, e.g. 'batch/.*=data'"
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
    args = parser.parse_args(argv)
    if args.command == "rules":
        from jaxshard.rule import covered_primitives

        print("\n".join(covered_primitives()))
        return 0
    axes = [item.split("=") for item in args.mesh.split(",")]
    names, sizes = tuple(a for a, _ in axes), tuple(int(n) for _, n in axes)
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
    for item in args.hint:
        key, _, spec = item.rpartition("=")
        hints[key] = parse_spec(spec)
    devices = jax.devices()
    if len(devices) < math.prod(sizes):  # e.g. one GPU: plan on the simulated CPU devices
        devices = jax.devices("cpu")
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
