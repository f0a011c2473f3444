"""Explanation: a plan as plain text a person can read before anything compiles.

Three parts: every argument and result (path, shape, dtype, spec, per-device bytes,
origin), the predicted reshards (where, from which layout to which, the collective,
bytes per call and how many times it runs: a scan body's once per iteration), and the
totals (per-device memory of arguments against replicated, predicted communication per
call, with a note when while loops of unknown trip count make it a lower bound).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxshard.cost import (
    CollectiveKind,
    compute_flops,
    dtype_name,
    human_bytes,
    nbytes,
    per_device_bytes,
)
from jaxshard.graph import AppKind
from jaxshard.lattice import to_spec
from jaxshard.plan import register_stage

if TYPE_CHECKING:
    from jaxshard.plan import Plan


def runs_text(r) -> str:
    """How many times a reshard runs per call: ``"x12"`` in scans of 12 iterations,
    ``"x1+ (while)"`` in a while loop whose trip count planning cannot know.

    Example:
        >>> from types import SimpleNamespace as R
        >>> runs_text(R(runs=12, in_while=False)), runs_text(R(runs=1, in_while=True))
        ('x12', 'x1+ (while)')
    """
    return f"x{r.runs}" + ("+ (while)" if r.in_while else "")


def while_note(plan: Plan) -> str:
    """A sentence on reshards inside while loops (counted once each), or ``""``.

    Example:
        >>> while_note(plan)  # doctest: +SKIP
        '2 reshards inside while loops count once per loop: their trip count is not ...'
    """
    n = len(plan.while_reshards)
    if not n:
        return ""
    return (
        f"{n} reshard{'s' * (n != 1)} inside while loops count once per loop: their trip "
        "count is not known when planning, so the total is a lower bound"
    )


def _partial_text(axes) -> str:
    return f" (partial over {', '.join(sorted(axes))})" if axes else ""


def _layout_text(r) -> str:
    """A reshard's layouts: ``from -> to``, or the one layout of a halo exchange (a
    windowed equation's neighbours' rows, the layout unchanged)."""
    if r.src == r.dst and not r.partial and all(s.kind == CollectiveKind.PERMUTE for s in r.steps):
        return f"{to_spec(r.src)}, halo"
    return f"{to_spec(r.src)}{_partial_text(r.partial)} -> {to_spec(r.dst)}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    widths[-1] = 0  # last column (origin / collectives) is free text
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * max(w, 6) for w in widths]), *map(line, rows)])


def explain_plan(plan: Plan, max_reshards: int = 40, intermediates: bool = False) -> str:
    """The text of `Plan.explain`; with ``intermediates``, every equation's results too,
    named by primitive and user source line.

    Example:
        >>> print(explain_plan(plan, intermediates=True))  # doctest: +SKIP
    """
    g, sizes = plan.graph, plan.axis_sizes
    rows = []
    named = [(n, v, plan.dims[v]) for n, v in zip(plan.traced.in_names, g.in_vids)]
    named += [(n, v, d) for n, v, d in zip(plan.traced.out_names, g.out_vids, plan.out_dims)]
    if intermediates:
        for app in g.apps:
            if app.kind is AppKind.EQN:
                label = app.describe()
                named += [
                    (f"%{v} = {label}", v, plan.dims[v]) for v in app.results if v not in g.names
                ]
    for name, vid, dims in named:
        shape, dtype = g.shapes[vid], g.dtypes[vid]
        rows.append(
            [
                name,
                str(tuple(shape)),
                dtype_name(dtype),
                str(to_spec(dims)),
                human_bytes(per_device_bytes(shape, dtype, dims, sizes)),
                plan.origin_text(vid),
            ]
        )
    mesh = " x ".join(f"{a}={n}" for a, n in sizes.items())
    out = [
        f"jaxshard plan on mesh ({mesh}): {len(g.apps)} rule applications, {plan.visits} visits",
        "",
        _table(rows, ["path", "shape", "dtype", "spec", "per device", "origin"]),
    ]
    if plan.pipelined:
        out += ["", f"pipeline ({len(plan.pipelined)} scan(s)):"]
        out += [loop.describe() for loop in plan.pipelined]
    if plan.written:
        out += ["", f"collectives the program writes itself ({len(plan.written)}):"]
        out.append(
            _table(
                [
                    [
                        c.line,
                        c.kind,
                        ",".join(sorted(c.axes)),
                        human_bytes(c.ring_bytes * c.runs),
                        str(c.runs),
                    ]
                    for c in plan.written
                ],
                ["at", "collective", "axes", "bytes/device/call", "runs"],
            )
        )
    out += ["", f"reshards and pending reductions ({len(plan.reshards)}):"]
    if plan.reshards:
        rrows = [
            [
                r.where,
                g.names.get(r.vid, f"%{r.vid}"),
                _layout_text(r),
                human_bytes(r.call_bytes),
                runs_text(r),
                ", ".join(r.collectives),
            ]
            for r in sorted(plan.reshards, key=lambda r: -r.call_bytes)[:max_reshards]
        ]
        header = ["at", "value", "layout", "bytes/device/call", "runs", "collectives"]
        out.append(_table(rrows, header))
        if len(plan.reshards) > max_reshards:
            out.append(f"... and {len(plan.reshards) - max_reshards} smaller ones")
    else:
        out.append("none")
    for c in plan.conflicts:
        opts = "; ".join(f"{to_spec([o])} held by {len(h)}" for o, h in c.options.items())
        out.append(
            f"conflict at {g.apps[c.app].describe()} on {c.factor}: {opts} -> "
            f"{to_spec([c.chosen])} ({c.reason})"
        )
    device, total = plan.per_device_bytes()
    memory = plan.estimated_memory
    results_device = sum(
        per_device_bytes(g.shapes[v], g.dtypes[v], d, sizes)
        for v, d in zip(g.out_vids, plan.out_dims)
    )
    out += [
        "",
        f"arguments: {human_bytes(device)} per device ({human_bytes(total)} replicated)",
        f"results: {human_bytes(results_device)} per device "
        f"({human_bytes(sum(nbytes(g.shapes[v], g.dtypes[v]) for v in g.out_vids))} replicated)",
        f"estimated memory: {human_bytes(memory.total)} per device (arguments "
        f"{human_bytes(memory.arguments)}, results {human_bytes(memory.results)}, peak "
        f"intermediates {human_bytes(memory.activations)})",
        *_peak_lines(plan, memory),
        f"predicted communication: {human_bytes(plan.predicted_bytes)} per device per call"
        + (f" ({while_note(plan)})" if plan.while_reshards else ""),
        f"predicted compute: {compute_flops(plan) / 1e9:.3g} GFLOP per device per call "
        "(matrix multiplies and convolutions"
        + ("; the pipeline's bubble iterations included)" if plan.pipelined else ")"),
    ]
    return "\n".join(out)


def _peak_lines(plan: Plan, memory, shown: int = 6) -> list[str]:
    """The largest buffers the estimate holds at its peak (`Plan.peak_buffers`)."""
    if memory.peak_app < 0:
        return []
    found = plan.peak_buffers()
    lines = [f"  largest at the peak (at {plan.graph.apps[memory.peak_app].describe()}):"]
    lines += [f"    {human_bytes(b):>10}  {what}" for b, what in found[:shown]]
    if len(found) > shown:
        rest = sum(b for b, _ in found[shown:])
        lines.append(f"    {human_bytes(rest):>10}  in {len(found) - shown} smaller buffers")
    return lines


register_stage("explain", explain_plan)
