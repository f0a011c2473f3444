"""Command line: ``python -m jaxshard rules`` lists the primitives the catalogue covers."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m jaxshard``.

    Example:
        >>> main(["rules"])  # doctest: +ELLIPSIS
        abs
        ...
        0
    """
    parser = argparse.ArgumentParser(prog="jaxshard", description="jaxshard tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("rules", help="list the primitives that have sharding rules")
    args = parser.parse_args(argv)
    if args.command == "rules":
        import jaxshard.rules  # noqa: F401 - registers the catalogue
        from jaxshard.rule import covered_primitives

        print("\n".join(covered_primitives()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
