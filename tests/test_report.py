"""The HTML report: the GPT example's page rendered in headless Chromium (Debian packages
``chromium`` + ``chromium-driver``; ``.ci/chromium`` installs them), checked on the DOM
after its script ran and on the screenshot's pixels; blocks, grids and escaping as units."""

import html
import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import gpt
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard.explain import human_bytes
from jaxshard.report import block_text, html_report, shard_block, write_report

CHROMIUM = next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium not installed: apt-get install -y chromium chromium-driver",
)
WIDTH, HEIGHT = 1400, 2000


# --- rendering ------------------------------------------------------------------------


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, attrs, parent, [], ""

    def classes(self):
        return set((self.attrs.get("class") or "").split())

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    def find(self, tag=None, cls=None, **attrs):
        return [
            n
            for n in self.walk()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes())
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def all_text(self):
        return self.text + "".join(c.all_text() for c in self.children)


class TreeBuilder(HTMLParser):
    """The dumped DOM as a tree of Nodes (stdlib only)."""

    VOID = {"meta", "input", "br", "img", "link", "hr"}

    def __init__(self):
        super().__init__()
        self.root = self.node = Node("#root", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.node)
        self.node.children.append(node)
        if tag not in self.VOID:
            self.node = node

    def handle_startendtag(self, tag, attrs):
        self.node.children.append(Node(tag, dict(attrs), self.node))

    def handle_endtag(self, tag):
        node = self.node
        while node.parent is not None and node.tag != tag:
            node = node.parent
        if node.parent is not None:
            self.node = node.parent

    def handle_data(self, data):
        self.node.text += data


def render(page_path, tmp_path, fragment="", screenshot=None):
    """Load the page in headless Chromium: the DOM after scripts ran, and a screenshot."""
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--window-size={WIDTH},{HEIGHT}",
        "--dump-dom",
    ]
    if screenshot is not None:
        cmd.append(f"--screenshot={screenshot}")
    cmd.append(f"file://{page_path}{fragment}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    builder = TreeBuilder()
    builder.feed(done.stdout)
    return builder.root


def png_rows(path):
    """``(width, height)`` and the RGB rows, top down, of an 8-bit RGB(A) PNG (a tiny
    decoder on zlib and numpy: rows are decoded lazily, so a caller can stop early)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        chunk, pos = data[pos + 8 : pos + 8 + n], pos + 12 + n
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat.append(chunk)
    assert depth == 8 and ctype in (2, 6), (depth, ctype)
    bpp, raw = (3 if ctype == 2 else 4), zlib.decompress(b"".join(idat))
    stride = w * bpp
    assert len(raw) == h * (stride + 1), "truncated image data"
    return (w, h), _unfilter(raw, w, h, bpp)


def _unfilter(raw, w, h, bpp):
    stride, prev = w * bpp, np.zeros(w * bpp, np.int64)
    for y in range(h):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        if kind == 0:
            cur = line
        elif kind == 1:  # Sub
            cur = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif kind == 2:  # Up
            cur = (line + prev) % 256
        else:  # Average, Paeth: sequential along the row
            cur, up = line.tolist(), prev.tolist()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                if kind == 3:
                    cur[i] = (cur[i] + ((a + up[i]) >> 1)) & 255
                    continue
                b, c = up[i], (up[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.array(cur, np.int64)
        prev = cur
        yield cur.reshape(w, bpp)[:, :3]


# --- the GPT example -------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_plan(mesh):
    step, args, hints = gpt.factory()
    return jaxshard.make_plan(step, args, {}, mesh, hints)


@pytest.fixture(scope="module")
def page(gpt_plan, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "gpt.html"
    assert write_report(gpt_plan, path, title="GPT example") == os.fspath(path)
    return path


@pytest.fixture(scope="module")
def rendered(page, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chromium")
    if CHROMIUM is None:
        pytest.skip("headless Chromium not installed: apt-get install -y chromium chromium-driver")
    shot = tmp / "report.png"
    return render(page, tmp, screenshot=shot), shot


def cell_texts(row):
    return [c.all_text().strip() for c in row.children if c.tag in ("td", "th")]


@needs_chromium
def test_layer_table_shows_every_layer_with_its_specs(rendered):
    dom, _ = rendered
    (table,) = dom.find("table", data_group="params/layers/<i>")
    header, *layers = [r for r in table.find("tr")]
    columns = cell_texts(header)
    assert {"attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/w1", "mlp/w2"} <= set(columns)
    assert len(layers) == 2 and [cell_texts(r)[0] for r in layers] == ["0", "1"]
    for row in layers:
        spec = dict(zip(columns, cell_texts(row)))
        assert spec["attn/wq"] == spec["attn/wk"] == spec["mlp/w1"] == "P(None, 'model')"
        assert spec["attn/wo"] == spec["mlp/w2"] == "P('model',)"
        assert spec["ln1/scale"] == "P()"
    assert not table.find(cls="differs")  # both layers laid out alike
    assert dom.find("table", data_group="opt_state/0/mu/layers/<i>")


@needs_chromium
def test_every_argument_is_drawn_on_the_mesh(rendered, gpt_plan):
    dom, _ = rendered
    cards = {c.attrs["data-path"]: c for c in dom.find("div", cls="card")}
    assert list(cards) == list(gpt_plan.traced.in_names)
    for path, card in cards.items():
        (svg,) = card.find("svg")
        cells = svg.find("g", cls="dev")
        assert sorted(int(c.attrs["data-device"]) for c in cells) == list(range(8)), path

    def blocks(path):
        return {
            c.find("text", cls="id")[0].all_text(): (
                int(c.attrs["data-shard"]),
                c.find("text", cls="blk")[0].all_text(),
            )
            for c in cards[path].find("g", cls="dev")
        }

    # wq: P(None, 'model') on data=2 x model=4 -> device (d, m) holds columns 16m:16m+16.
    wq = blocks("params/layers/0/attn/wq")
    devices = gpt_plan.mesh.devices
    for d in range(2):
        for m in range(4):
            assert wq[f"dev {devices[d, m].id}"] == (m, f"[:, {16 * m}:{16 * m + 16}]")
    assert blocks("params/layers/1/mlp/w2")[f"dev {devices[1, 3].id}"] == (3, "[192:256, :]")
    # a leaf the plan replicates is drawn in one colour, one split over "model" in four
    names = dict(zip(gpt_plan.traced.in_names, gpt_plan.graph.in_vids))
    specs = {n: gpt_plan.spec(v) for n, v in names.items() if n.startswith("params/")}
    replicated = next(n for n, spec in specs.items() if all(e is None for e in spec))
    assert {s for s, _ in blocks(replicated).values()} == {0}, replicated
    split = next(n for n, spec in specs.items() if tuple(spec) in ((None, "model"), ("model",)))
    assert len({s for s, _ in blocks(split).values()}) == 4, split
    assert blocks("batch/tok")[f"dev {devices[1, 2].id}"][1].startswith("[4:8")


@needs_chromium
def test_reshard_table_lists_collectives_largest_first(rendered, gpt_plan):
    dom, _ = rendered
    rows = dom.find("tr", cls="reshard")
    assert len(rows) == len(gpt_plan.reshards) > 0
    texts = [cell_texts(r) for r in rows]
    largest = sorted(gpt_plan.reshards, key=lambda r: -r.call_bytes)
    assert [t[0] for t in texts] == [human_bytes(r.call_bytes) for r in largest]
    assert {t[1] for t in texts} == {"x1"}  # the GPT example has no loop
    assert any(t[2] == "all-reduce over model" and "partial over model" in t[4] for t in texts)
    assert any(t[2] == "all-reduce over data" for t in texts)
    (total,) = dom.find("tr", cls="total")
    assert cell_texts(total)[0] == human_bytes(gpt_plan.predicted_bytes)
    assert dom.find("b", id="comm")[0].all_text() == human_bytes(gpt_plan.predicted_bytes)


@needs_chromium
def test_totals_show_memory_against_replicated(rendered, gpt_plan):
    dom, _ = rendered
    (table,) = dom.find("table", cls="totals")
    rows = {cell_texts(r)[0]: cell_texts(r)[1:] for r in table.find("tr")[1:]}
    device, total = gpt_plan.per_device_bytes("params/")
    assert rows["arguments: params"][:2] == [human_bytes(device), human_bytes(total)]
    assert set(rows) >= {"arguments: opt_state", "arguments: batch", "arguments: all", "results"}


@needs_chromium
def test_script_counts_and_filters_the_drawings(rendered, page, tmp_path):
    dom, _ = rendered
    n = len(dom.find("div", cls="card"))
    assert dom.find("span", id="shown")[0].all_text() == f"{n} of {n} arrays shown"
    filtered = render(page, tmp_path, fragment="#filter=" + "params/layers/1/attn/w%5Bqk%5D")
    shown = [
        c.attrs["data-path"]
        for c in filtered.find("div", cls="card")
        if "hidden" not in c.classes()
    ]
    assert shown == ["params/layers/1/attn/wk", "params/layers/1/attn/wq"]
    assert filtered.find("span", id="shown")[0].all_text() == f"2 of {n} arrays shown"


@needs_chromium
def test_screenshot_shows_the_page(rendered):
    _, shot = rendered
    size, rows = png_rows(shot)
    assert size == (WIDTH, HEIGHT) and os.path.getsize(shot) > 50_000
    # Read down to the first mesh grids: cells of shard 0 are hsl(0, 70%, 70%) = rgb(232,
    # 125, 125), painted by the SVGs.
    seen, red = [], 0
    for row in rows:
        seen.append(row)
        red += int((np.abs(row - [232, 125, 125]).max(axis=-1) <= 3).sum())
        if red > 1000:
            break
    assert red > 1000, "no mesh cell of shard 0 painted"
    colours = np.unique(np.concatenate(seen), axis=0)
    assert len(colours) > 100, "the rendered page is (nearly) one colour"


# --- units -------------------------------------------------------------------------------

SIZES = {"data": 2, "model": 4}


@pytest.mark.parametrize(
    "shape, dims, coords, block, index, count",
    [
        ((8, 16), [(), ()], {"data": 1, "model": 3}, ((0, 8), (0, 16)), 0, 1),
        ((8, 16), [("data",), ("model",)], {"data": 1, "model": 3}, ((4, 8), (12, 16)), 7, 8),
        ((8, 16), [("model",), ("data",)], {"data": 1, "model": 3}, ((6, 8), (8, 16)), 7, 8),
        ((16,), [("data", "model")], {"data": 1, "model": 2}, ((12, 14),), 6, 8),
        ((16,), [("model", "data")], {"data": 1, "model": 2}, ((10, 12),), 5, 8),
        ((), [], {"data": 0, "model": 0}, (), 0, 1),
    ],
    ids=[
        "replicated",
        "data-model",
        "model-data",
        "two-axes-major-data",
        "two-axes-major-model",
        "scalar",
    ],
)
def test_shard_block(shape, dims, coords, block, index, count):
    assert shard_block(shape, dims, SIZES, coords) == (block, index, count)


def test_block_text():
    assert block_text((8, 16, 4), ((0, 8), (4, 8), (0, 4))) == "[:, 4:8, :]"


@pytest.mark.parametrize("shape", [(8,), (2, 4), (2, 2, 2)], ids=["1d", "2d", "3d"])
def test_every_device_drawn_once_on_any_mesh(shape):
    names = ("a", "b", "c")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    plan = jaxshard.make_plan(lambda x: x * 2, (jnp.ones((8, 8)),), {}, mesh, {"x": P(names[0])})
    page = html_report(plan)
    ids = sorted(int(s.split("'")[0]) for s in page.split("data-device='")[1:])
    assert ids == list(range(8))


def test_text_is_escaped_and_nothing_is_fetched(mesh):
    args = ({"<b>&x": jnp.ones((8, 4))},)
    plan = jaxshard.make_plan(lambda d: d["<b>&x"] + 1, args, {}, mesh, {})
    page = html_report(plan, title="<script>alert(1)</script>")
    assert "<script>alert" not in page and html.escape("<script>alert(1)</script>") in page
    assert "<b>&x" not in page and "d/&lt;b&gt;&amp;x" in page
    assert "<link" not in page and "src=" not in page and "https:" not in page
    assert page.count("http:") == page.count("xmlns='http://www.w3.org/2000/svg'")
