"""The HTML report: a plan as one self-contained page (inline CSS, SVG and JS; no network).

Four parts, for a person deciding whether to trust a plan before anything compiles:

- **totals**: the mesh, per-device memory of the arguments (per top-level argument and
  in all) against replicated, and the predicted communication per call;
- **layers**: every group of paths that differ only in a numeric component
  (``params/layers/<i>/attn/wq``) as a table of layers x parameter names with the spec in
  each cell, so a repeated layer laid out differently stands out;
- **shardings on the mesh**: for every argument leaf, a grid of the mesh's devices (rows:
  the first mesh axis; columns: the others, flattened) where each cell names the block of
  the array that device holds, in numpy slice notation, coloured by shard: devices of one
  colour hold the same block, so a replicated array is one colour throughout;
- **reshards**: the predicted collectives, largest first, with where, value, layout change,
  bytes per device per call and how many times each runs (a scan body's once per
  iteration; a while loop's trip count is unknown, so its reshards count once).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxshard.plan import make_plan
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
    >>> plan = make_plan(lambda x, w: x @ w, (jnp.ones((8, 4)), jnp.ones((4, 16))), {}, mesh,
    ...                  {"x": P("data"), "w": P(None, "model")})
    >>> page = html_report(plan, title="x @ w")
    >>> page.startswith("<!DOCTYPE html>"), page.count("data-device=")
    (True, 16)
"""

from __future__ import annotations

import html
import itertools
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from jaxshard.cost import dtype_name, human_bytes, nbytes, per_device_bytes
from jaxshard.explain import runs_text, while_note
from jaxshard.lattice import DimSharding, to_spec

if TYPE_CHECKING:
    from jaxshard.plan import Plan

Block = tuple[tuple[int, int], ...]  # per dim, the [start, stop) range a device holds


def shard_block(
    shape: Sequence[int],
    dims: Sequence[DimSharding],
    axis_sizes: Mapping[str, int],
    coords: Mapping[str, int],
) -> tuple[Block, int, int]:
    """The block of an array a device holds, the block's shard index, and the shard count.

    A dim sharded on axes ``(a, b)`` is cut into ``size(a) * size(b)`` pieces; the device's
    piece is the mixed-radix index of its coordinates on those axes, major to minor. The
    shard index numbers the blocks the same way across dims, so devices with one index hold
    the same data.

    Example:
        >>> sizes = {"data": 2, "model": 4}
        >>> shard_block((8, 16), [(), ("model",)], sizes, {"data": 1, "model": 2})
        (((0, 8), (8, 12)), 2, 4)
        >>> shard_block((8, 16), [("model", "data"), ()], sizes, {"data": 1, "model": 2})
        (((5, 6), (0, 16)), 5, 8)
    """
    block, index, count = [], 0, 1
    for size, axes in zip(shape, dims):
        piece, pieces = 0, 1
        for a in axes or ():
            piece, pieces = piece * axis_sizes[a] + coords[a], pieces * axis_sizes[a]
        step = size // pieces
        block.append((piece * step, (piece + 1) * step))
        index, count = index * pieces + piece, count * pieces
    return tuple(block), index, count


def block_text(shape: Sequence[int], block: Block) -> str:
    """A block in numpy slice notation; ``:`` is a whole dim.

    Example:
        >>> block_text((8, 16), ((0, 8), (8, 12))), block_text((), ())
        ('[:, 8:12]', 'scalar')
    """
    if not shape:
        return "scalar"
    parts = [":" if (lo, hi) == (0, n) else f"{lo}:{hi}" for n, (lo, hi) in zip(shape, block)]
    return "[" + ", ".join(parts) + "]"


def html_report(plan: Plan, title: str = "jaxshard plan") -> str:
    """A self-contained HTML page showing ``plan``: totals, the layer-by-layer view,
    every argument's sharding drawn on the mesh, and the predicted reshards.

    Example:
        >>> page = html_report(plan)  # doctest: +SKIP
        >>> open("plan.html", "w").write(page)  # doctest: +SKIP
    """
    body = [
        f"<h1>{_e(title)}</h1>",
        _totals(plan),
        _legend(),
        _layers(plan),
        _mesh_section(plan),
        _reshards(plan),
    ]
    return _PAGE.format(title=_e(title), css=_CSS, js=_JS, body="\n".join(body))


def write_report(plan: Plan, path: str | os.PathLike, title: str = "jaxshard plan") -> str:
    """Write `html_report` to ``path`` (UTF-8) and return the path as a string.

    Example:
        >>> write_report(plan, "plan.html")  # doctest: +SKIP
        'plan.html'
    """
    with open(path, "w", encoding="utf-8") as f:
        f.write(html_report(plan, title))
    return os.fspath(path)


# --- parts ---------------------------------------------------------------------------


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _spec(dims: Sequence[DimSharding]) -> str:
    return str(to_spec(dims))


def _args(plan: Plan):
    """(name, vid, shape, dtype, dims) per argument leaf."""
    g = plan.graph
    for name, vid in zip(plan.traced.in_names, g.in_vids):
        yield name, vid, tuple(g.shapes[vid]), g.dtypes[vid], plan.dims[vid]


def _totals(plan: Plan) -> str:
    g, sizes = plan.graph, plan.axis_sizes
    mesh = " &times; ".join(f"{_e(a)}={n}" for a, n in sizes.items())
    rows = []
    for top in dict.fromkeys(n.split("/")[0] for n in plan.traced.in_names):
        dev, tot = plan.per_device_bytes(top + "/")
        dev, tot = (dev, tot) if tot else plan.per_device_bytes(top)
        rows.append((f"arguments: {top}", dev, tot))
    rows.append(("arguments: all", *plan.per_device_bytes()))
    res_dev = sum(
        per_device_bytes(g.shapes[v], g.dtypes[v], d, sizes)
        for v, d in zip(g.out_vids, plan.out_dims)
    )
    res_tot = sum(nbytes(g.shapes[v], g.dtypes[v]) for v in g.out_vids)
    rows.append(("results", res_dev, res_tot))
    trs = "".join(
        f"<tr><td>{_e(k)}</td><td class=num>{human_bytes(d)}</td>"
        f"<td class=num>{human_bytes(t)}</td><td class=num>{t / d if d else 1:.2f}x</td></tr>"
        for k, d, t in rows
    )
    return (
        '<section id="totals"><h2>Totals</h2>'
        f"<p>Mesh <code>{mesh}</code> ({plan.mesh.devices.size} devices), "
        f"{len(g.apps)} rule applications. Predicted communication: "
        f"<b id=comm>{human_bytes(plan.predicted_bytes)}</b> per device per call in "
        f"{len(plan.reshards)} reshards and pending reductions; "
        f"{len(plan.conflicts)} conflicts decided.{_while_text(plan)}</p>"
        "<table class=totals><tr><th>memory</th><th>per device</th><th>replicated</th>"
        f"<th>saving</th></tr>{trs}</table></section>"
    )


def _legend() -> str:
    swatches = " ".join(
        f"<span class=swatch style='background:{_palette(i, n)}'>{text}</span>"
        for i, n, text in [
            (0, 4, "shard 1 of 4"),
            (1, 4, "shard 2 of 4"),
            (2, 4, "shard 3 of 4"),
            (3, 4, "shard 4 of 4"),
            (0, 1, "replicated"),
        ]
    )
    return (
        '<section id="legend"><h2>Legend</h2><ul>'
        "<li>Specs read like <code>P(None, 'model')</code>: dim 0 replicated, dim 1 split "
        "over the <code>model</code> mesh axis; <code>P()</code> is fully replicated.</li>"
        "<li>In the layer tables, <span class='spec sharded'>sharded</span> and "
        "<span class='spec replicated'>replicated</span> cells are tinted; a cell that "
        "differs from the usual spec of its column is <span class='spec differs'>outlined"
        "</span>.</li>"
        "<li>Mesh grids: one cell per device (rows: first mesh axis; columns: the others). "
        "Each cell shows the device id and the block it holds in numpy slice notation "
        "(<code>:</code> = the whole dim). Cells of one colour hold the same block, so a "
        f"replicated array is one colour throughout: {swatches}</li></ul></section>"
    )


def _layer_groups(names: Sequence[str]) -> dict[str, dict[int, dict[str, str]]]:
    """Paths grouped by their last numeric component: {prefix/<i>: {i: {rest: path}}}."""
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        parts = name.split("/")
        idx = [i for i, p in enumerate(parts) if p.isdigit()]
        if not idx:
            continue
        i = idx[-1]
        key = "/".join([*parts[:i], "<i>"])
        groups.setdefault(key, {}).setdefault(int(parts[i]), {})["/".join(parts[i + 1 :])] = name
    return {k: v for k, v in groups.items() if len(v) > 1}


def _layers(plan: Plan) -> str:
    dims = {name: (shape, d) for name, _, shape, _, d in _args(plan)}
    out = ['<section id="layers"><h2>Layer by layer</h2>']
    groups = _layer_groups(plan.traced.in_names)
    if not groups:
        out.append(
            "<p>No repeated layers by path: no argument path has a numeric component. "
            "Stacked (scanned) layers share one spec per array: see the drawings below.</p>"
        )
    for key, layers in groups.items():
        cols = list(dict.fromkeys(c for row in layers.values() for c in sorted(row)))
        usual = {
            c: Counter(_spec(dims[r[c]][1]) for r in layers.values() if c in r).most_common(1)[0][0]
            for c in cols
        }
        head = "".join(f"<th>{_e(c)}</th>" for c in cols)
        trs = []
        for i in sorted(layers):
            cells = []
            for c in cols:
                path = layers[i].get(c)
                if path is None:
                    cells.append("<td></td>")
                    continue
                shape, d = dims[path]
                spec = _spec(d)
                cls = "sharded" if any(d) else "replicated"
                cls += " differs" if spec != usual[c] else ""
                cells.append(
                    f"<td class='spec {cls}' title='{_e(path)} {_e(shape)}'>{_e(spec)}</td>"
                )
            trs.append(f"<tr class=layer><th>{i}</th>{''.join(cells)}</tr>")
        is_open = " open" if key.startswith("params") or len(groups) == 1 else ""
        out.append(
            f"<details class=layers{is_open}><summary><code>{_e(key)}</code>: "
            f"{len(layers)} layers</summary><table class=layertable data-group='{_e(key)}'>"
            f"<tr><th>layer</th>{head}</tr>{''.join(trs)}</table></details>"
        )
    out.append("</section>")
    return "".join(out)


def _palette(index: int, count: int) -> str:
    if count == 1:
        return "#dbe4ee"
    return f"hsl({round(360 * index / count)}, 70%, {78 if index % 2 else 70}%)"


def _grid(axis_sizes: Mapping[str, int]) -> list[list[dict[str, int]]]:
    """Device coordinates as rows of cells: rows over the first axis, columns over the rest."""
    names = list(axis_sizes)
    if len(names) <= 1:
        return [[{n: i for n in names} for i in range(math.prod(axis_sizes.values()))]]
    rest = [range(axis_sizes[n]) for n in names[1:]]
    return [
        [{names[0]: r, **dict(zip(names[1:], c))} for c in itertools.product(*rest)]
        for r in range(axis_sizes[names[0]])
    ]


def _mesh_svg(plan: Plan, name: str, shape: tuple[int, ...], dims) -> str:
    sizes, devices = plan.axis_sizes, plan.mesh.devices
    names = list(sizes)
    grid = _grid(sizes)
    cells = [(coords, *shard_block(shape, dims, sizes, coords)) for row in grid for coords in row]
    labels = [block_text(shape, b) for _, b, _, _ in cells]
    heads = [
        ",".join(f"{n}={c[n]}" for n in names[1:]) or f"{names[0]}={i}"
        for i, c in enumerate(grid[0])
    ]
    cw = max(64, 7 * max(map(len, labels)) + 14, 6 * max(map(len, heads)) + 10)
    ch, lw, th = 40, 62, 16
    ncols = len(grid[0])
    width, height = lw + ncols * cw, th + len(grid) * ch
    out = [
        f"<svg class=mesh xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{_e(name)} on the mesh'>"
    ]
    for c, text in enumerate(heads):
        out.append(f"<text class=axis x='{lw + c * cw + cw / 2}' y='11'>{_e(text)}</text>")
    if len(names) > 1:
        for r in range(len(grid)):
            y = th + r * ch + ch / 2 + 4
            out.append(f"<text class=axis x='{lw / 2}' y='{y}'>{_e(names[0])}={r}</text>")
    for k, ((coords, _, index, count), label) in enumerate(zip(cells, labels)):
        r, c = divmod(k, ncols)
        x, y = lw + c * cw, th + r * ch
        dev = devices[tuple(coords[n] for n in names)].id
        where = ", ".join(f"{n}={coords[n]}" for n in names)
        tip = f"device {dev} ({where}) holds {label} of {shape}: shard {index + 1} of {count}"
        out.append(
            f"<g class=dev data-device='{dev}' data-shard='{index}'><title>{_e(tip)}</title>"
            f"<rect x='{x + 1}' y='{y + 1}' width='{cw - 2}' height='{ch - 2}' rx='4' "
            f"fill='{_palette(index, count)}'/>"
            f"<text class=id x='{x + cw / 2}' y='{y + 14}'>dev {dev}</text>"
            f"<text class=blk x='{x + cw / 2}' y='{y + 30}'>{_e(label)}</text></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _mesh_section(plan: Plan) -> str:
    sizes = plan.axis_sizes
    by_top: dict[str, list[str]] = {}
    for name, vid, shape, dtype, dims in _args(plan):
        dtype_text = dtype_name(dtype)
        card = (
            f"<div class=card data-path='{_e(name)}'><div class=path>{_e(name)}</div>"
            f"<div class=meta><code>{_e(shape)}</code> {_e(dtype_text)} "
            f"<code class=spec>{_e(_spec(dims))}</code> "
            f"{human_bytes(per_device_bytes(shape, dtype, dims, sizes))} per device</div>"
            f"{_mesh_svg(plan, name, shape, dims)}"
            f"<div class=origin>{_e(plan.origin_text(vid))}</div></div>"
        )
        by_top.setdefault(name.split("/")[0], []).append(card)
    out = [
        '<section id="mesh"><h2>Shardings on the mesh</h2>',
        "<p><label>Filter paths (regular expression): <input id=filter "
        "placeholder='e.g. layers/0/.*w'></label> <span id=shown></span></p>",
    ]
    many = sum(map(len, by_top.values())) > 60
    for k, (top, cards) in enumerate(by_top.items()):
        opened = top == "params" if "params" in by_top else (k == 0 or not many)
        is_open = " open" if opened else ""
        out.append(
            f"<details class=group{is_open}><summary><code>{_e(top)}</code>: "
            f"{len(cards)} array{'s' * (len(cards) != 1)}</summary><div class=cards>{''.join(cards)}</div></details>"
        )
    out.append("</section>")
    return "".join(out)


def _while_text(plan: Plan) -> str:
    note = while_note(plan)
    return f" <span class=warn>{_e(note)}.</span>" if note else ""


def _reshards(plan: Plan, limit: int = 500) -> str:
    g = plan.graph
    rs = sorted(plan.reshards, key=lambda r: -r.call_bytes)
    top = rs[0].call_bytes if rs and rs[0].call_bytes else 1.0
    trs = []
    for r in rs[:limit]:
        partial = f" (partial over {', '.join(sorted(r.partial))})" if r.partial else ""
        change = f"{_spec(r.src)}{partial} → {_spec(r.dst)}"
        value = g.names.get(r.vid, f"%{r.vid}")
        trs.append(
            "<tr class=reshard>"
            f"<td class=num>{human_bytes(r.call_bytes)}<div class=bar "
            f"style='width:{100 * r.call_bytes / top:.0f}%'></div></td>"
            f"<td class=num>{_e(runs_text(r))}</td>"
            f"<td class=ops>{_e(', '.join(r.collectives))}</td>"
            f"<td class=value><code>{_e(value)}</code> "
            f"<span class=dim>{_e(tuple(g.shapes[r.vid]))}</span></td>"
            f"<td><code>{_e(change)}</code></td><td class=where>{_e(r.where)}</td></tr>"
        )
    more = f"<p>... and {len(rs) - limit} smaller ones.</p>" if len(rs) > limit else ""
    conflicts = "".join(
        f"<li>at {_e(g.apps[c.app].describe())} on factor {_e(c.factor)}: chose "
        f"<code>{_e(to_spec([c.chosen]))}</code> ({_e(c.reason)})</li>"
        for c in plan.conflicts
    )
    return (
        '<section id="reshards"><h2>Reshards and pending reductions</h2>'
        f"<p>{len(rs)} predicted, {human_bytes(plan.predicted_bytes)} per device per call "
        "in all, largest first; a reshard in a scan body runs once per iteration."
        f"{_while_text(plan)}</p>"
        "<table class=reshards><tr><th>bytes / device / call</th><th>runs</th>"
        "<th>collectives</th><th>value</th>"
        f"<th>layout change</th><th>where</th></tr>{''.join(trs)}"
        f"<tr class=total><td class=num>{human_bytes(plan.predicted_bytes)}</td>"
        f"<td colspan=5>total</td></tr></table>{more}"
        + (f"<h3>Conflicts decided</h3><ul>{conflicts}</ul>" if conflicts else "")
        + "</section>"
    )


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{css}</style></head>
<body><nav><a href="#totals">totals</a> <a href="#layers">layers</a>
<a href="#mesh">mesh</a> <a href="#reshards">reshards</a></nav>
{body}
<script>{js}</script></body></html>
"""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 24px 40px;color:#1d2733}
nav{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #e3e8ee}
nav a{margin-right:14px;color:#2456a6;text-decoration:none}
h1{font-size:22px;margin:14px 0 4px}h2{font-size:18px;margin:22px 0 6px;
border-bottom:2px solid #2456a6;padding-bottom:2px}
code,.spec,.path,td.where,svg text{font-family:ui-monospace,'DejaVu Sans Mono',Menlo,monospace}
code,.spec{font-size:12.5px}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #d5dce4;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef2f6;font-weight:600;white-space:nowrap}td.num{text-align:right;white-space:nowrap}
td.spec.sharded{background:#e3f1e3}td.spec.replicated{background:#f4f5f7;color:#6b7785}
.spec.differs{outline:2px solid #d9480f;outline-offset:-2px}
span.spec{padding:0 4px}span.spec.sharded{background:#e3f1e3}
span.spec.replicated{background:#f4f5f7}
details{margin:6px 0}summary{cursor:pointer;font-weight:600;padding:3px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #d5dce4;border-radius:6px;padding:6px 8px;background:#fbfcfd}
.card.hidden{display:none}.path{font-weight:600;font-size:13px}
.meta{font-size:12px;color:#3d4a57;margin:2px 0 4px}
.origin{font-size:11px;color:#6b7785;max-width:520px}
svg.mesh text{font-size:11px;text-anchor:middle}svg.mesh text.axis{fill:#6b7785;font-size:10px}
svg.mesh text.id{fill:#3d4a57;font-size:10px}
.bar{height:3px;background:#2456a6;margin-top:2px}
td.ops,td.value{white-space:nowrap}td.where{font-size:11.5px;color:#3d4a57}.dim{color:#6b7785;font-size:12px}
span.swatch{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px}
tr.total td{font-weight:600;background:#eef2f6}.warn{color:#a33a00}
"""

_JS = """
(function(){
  var input=document.getElementById('filter'), shown=document.getElementById('shown');
  var cards=Array.prototype.slice.call(document.querySelectorAll('.card'));
  function apply(){
    var re=null; try{re=new RegExp(input.value);}catch(e){re=null;}
    var n=0;
    cards.forEach(function(c){
      var ok=!re||re.test(c.getAttribute('data-path'));
      c.classList.toggle('hidden',!ok); if(ok)n++;
    });
    shown.textContent=n+' of '+cards.length+' arrays shown';
    if(input.value){document.querySelectorAll('details.group').forEach(function(d){
      if(d.querySelector('.card:not(.hidden)'))d.open=true;});}
  }
  var m=/[#&]filter=([^&]*)/.exec(location.hash);
  if(m)input.value=decodeURIComponent(m[1]);
  input.addEventListener('input',apply); apply();
})();
"""
