"""Which devices share fast links: a `Topology` is a stack of levels (NVLink within a
node, InfiniBand across nodes; ICI within a TPU slice, DCN across slices), each with the
bandwidth and latency of a ring over it, plus the devices' peak FLOP/s and memory. A
mesh's axes are laid over the levels row-major (the last axis varies fastest, as
`jax.make_mesh` and a reshaped `jax.devices()` list order them), so an axis whose
devices stay within one node runs at NVLink speed and one that spans nodes at
InfiniBand's; `Topology.cost_model` turns that into the per-axis `CostModel` the search
prices layouts with and `jaxshard.auto_parallel` ranks whole strategies by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jaxshard.cost import CostModel, human_bytes
from jaxshard.errors import ShardingError


@dataclass(frozen=True)
class Level:
    """One level of a topology: groups of ``size`` devices (``None``: all the devices
    left, for the outermost level) joined by links where a ring collective moves
    ``bandwidth`` bytes per second per device and pays ``latency`` seconds per step.

    Example:
        >>> Level("NVLink", 8, 450e9, 3e-6).size
        8
    """

    name: str
    size: int | None
    bandwidth: float
    latency: float


# Published figures. H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet): 989 TFLOP/s dense
# BF16, 80 GB HBM3, NVLink 4 at 900 GB/s per GPU both directions together (450 GB/s each
# way); DGX H100 nodes: 8 GPUs, one 400 Gb/s ConnectX-7 InfiniBand NDR port per GPU
# (50 GB/s). Cloud TPU (cloud.google.com/tpu/docs/v5p, /v5e): v5p 459 TFLOP/s BF16, 95 GiB
# HBM, 1200 GB/s bidirectional ICI per chip over a 3-D torus (six links: 200 GB/s one
# way along each torus dimension), 50 Gb/s of data center network (DCN) per chip; v5e
# 197 TFLOP/s BF16, 16 GB HBM, 400 GB/s bidirectional ICI per chip over a 2-D torus
# (100 GB/s one way along each dimension), 2 x 100 Gb/s NICs per 8-chip host (25 Gb/s
# per chip). Latencies are typical per-step figures for those links, not datasheet ones.
_TPUS = {
    # version: (peak FLOP/s, HBM bytes, ICI bytes/s one way per torus dimension, DCN bytes/s)
    "v5p": (459e12, 95 * 2**30, 200e9, 50e9 / 8),
    "v5e": (197e12, 16e9, 100e9, 25e9 / 8),
}


@dataclass(frozen=True)
class Topology:
    """Levels of links, innermost (fastest) first, and each device's peak ``flops`` and
    ``memory`` (bytes; None: not known). Make one with `Topology.h100`, `Topology.tpu`
    or `Topology.generic`.

    Example:
        >>> t = Topology.h100(nodes=2)
        >>> t.devices, [level.name for level in t.levels]
        (16, ['NVLink', 'InfiniBand'])
        >>> t.cost_model(("data", "tensor"), (2, 8)).bandwidth  # tensor within a node
        {'data': 50000000000.0, 'tensor': 450000000000.0}
    """

    levels: tuple[Level, ...]
    flops: float
    memory: float | None = None
    name: str = "generic"

    def __post_init__(self) -> None:
        if not self.levels:
            raise ShardingError("a Topology needs at least one level of links")
        for level in self.levels[:-1]:
            if level.size is None:
                raise ShardingError(
                    f"Topology level {level.name!r} has no size: only the outermost level "
                    "may take all the devices left (size=None)"
                )
        for level in self.levels:
            if level.size is not None and (not isinstance(level.size, int) or level.size < 1):
                raise ShardingError(
                    f"Topology level {level.name!r}: size {level.size!r} is not a positive int"
                )
            if not level.bandwidth > 0 or level.latency < 0:
                raise ShardingError(
                    f"Topology level {level.name!r}: bandwidth must be positive and latency "
                    f"not negative (got {level.bandwidth!r}, {level.latency!r})"
                )
        if not self.flops > 0:
            raise ShardingError(f"Topology flops must be positive FLOP/s, not {self.flops!r}")

    @classmethod
    def h100(cls, nodes: int = 1) -> Topology:
        """``nodes`` DGX-style H100 SXM nodes: NVLink (450 GB/s each way) within 8 GPUs,
        InfiniBand NDR (50 GB/s per GPU) across nodes; 989 TFLOP/s BF16, 80 GB each.

        Example:
            >>> Topology.h100(nodes=8).devices
            64
        """
        _positive("Topology.h100(nodes=...)", nodes)
        levels = [Level("NVLink", 8, 450e9, 3e-6)]
        if nodes > 1:
            levels.append(Level("InfiniBand", nodes, 50e9, 10e-6))
        return cls(tuple(levels), 989e12, 80e9, f"H100 x{8 * nodes}")

    @classmethod
    def tpu(cls, version: str = "v5p", chips: int = 256, slices: int = 1) -> Topology:
        """``slices`` TPU slices of ``chips`` chips each: ICI within a slice, DCN across
        (``version`` ``"v5p"`` or ``"v5e"``; figures in the module's source).

        Example:
            >>> t = Topology.tpu("v5p", chips=512, slices=2)
            >>> t.devices, t.levels[1].name
            (1024, 'DCN')
        """
        if version not in _TPUS:
            raise ShardingError(
                f"Topology.tpu(version={version!r}): known versions are {sorted(_TPUS)}; "
                "for another, use Topology.generic with its figures"
            )
        _positive("Topology.tpu(chips=...)", chips)
        _positive("Topology.tpu(slices=...)", slices)
        flops, memory, ici, dcn = _TPUS[version]
        levels = [Level("ICI", chips, ici, 5e-6)]
        if slices > 1:
            levels.append(Level("DCN", slices, dcn, 25e-6))
        return cls(tuple(levels), flops, memory, f"TPU {version} {slices}x{chips}")

    @classmethod
    def generic(
        cls,
        levels: Sequence[tuple[int | None, float, float]],
        flops: float,
        memory: float | None = None,
    ) -> Topology:
        """Levels given as ``(devices per group, bytes/s, latency s)``, innermost first.

        Example:
            >>> Topology.generic([(4, 100e9, 5e-6), (None, 10e9, 20e-6)], flops=100e12).name
            'generic'
        """
        made = tuple(
            Level(f"level {i}", size, bandwidth, latency)
            for i, (size, bandwidth, latency) in enumerate(levels)
        )
        return cls(made, flops, memory)

    @classmethod
    def uniform(cls, model: CostModel, flops: float = 100e12) -> Topology:
        """Every device pair linked alike, at ``model``'s default bandwidth and latency
        (its ``flops`` when set, else ``flops``).

        Example:
            >>> Topology.uniform(CostModel()).levels[0].bandwidth
            100000000000.0
        """
        level = Level("links", None, model.default_bandwidth, model.default_latency)
        return cls((level,), model.flops or flops, None, "uniform")

    @property
    def devices(self) -> int | None:
        """How many devices the levels hold (None when the outermost takes any number)."""
        if self.levels[-1].size is None:
            return None
        return math.prod(level.size for level in self.levels)

    def axis_levels(self, sizes: Sequence[int]) -> list[Level]:
        """The slowest level each mesh axis of ``sizes`` (outermost first) spans: the
        first level whose device groups hold the axis's whole stride.

        Example:
            >>> [lv.name for lv in Topology.h100(nodes=4).axis_levels((4, 2, 4))]
            ['InfiniBand', 'NVLink', 'NVLink']
        """
        out = []
        for j, size in enumerate(sizes):
            span = size * math.prod(sizes[j + 1 :])
            held, level = 1, self.levels[-1]
            for candidate in self.levels:
                held = math.inf if candidate.size is None else held * candidate.size
                if held >= span:
                    level = candidate
                    break
            out.append(level)
        return out

    def cost_model(self, names: Sequence[str], sizes: Sequence[int]) -> CostModel:
        """The `CostModel` of a mesh with axes ``names`` of ``sizes`` laid over these
        levels, with these devices' peak FLOP/s.

        Example:
            >>> Topology.h100(nodes=2).cost_model(("data",), (16,)).bandwidth["data"]
            50000000000.0
        """
        levels = self.axis_levels(sizes)
        return CostModel(
            bandwidth={a: lv.bandwidth for a, lv in zip(names, levels)},
            latency={a: lv.latency for a, lv in zip(names, levels)},
            default_bandwidth=self.levels[0].bandwidth,
            default_latency=self.levels[0].latency,
            flops=self.flops,
        )

    def describe(self) -> str:
        """One line: the levels, their bandwidths, and the devices' figures.

        Example:
            >>> Topology.h100(nodes=2).describe()
            'H100 x16: NVLink 450 GB/s within 8, InfiniBand 50 GB/s across 2; 989 TFLOP/s, 74.5 GiB per device'
        """
        parts = []
        for i, lv in enumerate(self.levels):
            where = "within" if i == 0 else "across"
            size = "the rest" if lv.size is None else str(lv.size)
            parts.append(f"{lv.name} {lv.bandwidth / 1e9:g} GB/s {where} {size}")
        memory = f", {human_bytes(self.memory)} per device" if self.memory else ""
        return f"{self.name}: {', '.join(parts)}; {self.flops / 1e12:g} TFLOP/s{memory}"


def _positive(what: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ShardingError(f"{what} must be a positive int, not {n!r}")
