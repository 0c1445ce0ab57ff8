"""The parameter model of the sm90_wgmma family: what a setting is, and which settings are impossible.

One producer warpgroup fills a STAGES-deep ring of 128-byte-swizzled tiles with cp.async or TMA (mbarrier
completion); CONSUMERS warpgroups each own block_m / consumers rows of the C tile and run wgmma.mma_async
m64n{block_n}k16 (with swap_ab the consumers own the tile transposed: m64 per 64 columns, n{block_m}, so block_m
can be any multiple of 16: tiny M, or M just past a multiple of 64).
Field descriptions are what a prompt shows of a setting: they say what it does, not how fast it was once measured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator

from core.device import ARCH_LIMITS, DeviceFacts
from core.plan import LaunchPlan, ceil_div
from core.records import Problem
from templates.family import Params

LIMITS = ARCH_LIMITS["sm_90a"]  # what every setting must fit, on any sm_90 device
# The cp.async producer needs few registers (72 leave the persistent kn 256-row loop without spills); setmaxnreg hands
# the rest to the consumers, and the producer gives up more where the consumers need it.
PRODUCER_REGS_MAX, PRODUCER_REGS_MIN = 80, 56
TMA_PRODUCER_REGS = 40  # one thread issuing TMA copies needs few registers
WGMMA_EXTRA = 26  # ptxas (C7602) wants one m64nN wgmma's N/2 accumulators + 26 within the entry register cap
# Consumer registers beyond the accumulators (descriptors, loop state, addresses): ptxas asks for 26 more than the
# accumulators of one wgmma (C7602 "register target of ..."); a little slack for the epilogue.
CONSUMER_OVERHEAD = 32
# Rows of C a swapped tile's TMA stores move at a time (the kernel's C_CHUNK): two 8-column accumulator blocks
SWAP_C_CHUNK = 16


# Fields added after settings were first stored, each with its default: a setting names them only where it differs.
LATER_FIELDS = {"ping_pong": False, "raster_along": "m", "raster_snake": False, "c_panels": False,
                "tail_split": False, "b_panels": False, "mixed_tail": False}


class Sm90WgmmaParams(Params):
    block_m: int = Field(128, ge=16, le=256, multiple_of=16,
                         description="rows of C per thread block: 64, 128, 192 or 256; with swap_ab any multiple of 16")
    block_n: int = Field(256, ge=16, le=256, multiple_of=16,
                         description="columns of C per block = the wgmma N (kn: a multiple of 64, or b_panels)")
    block_k: Literal[64] = Field(64, description="K slice per stage: 64 16-bit elements = one 128-byte swizzle row")
    stages: int = Field(4, ge=2, le=12, description="depth of the shared-memory ring")
    consumers: Literal[1, 2, 3, 4] = Field(2, description="consumer warpgroups; each owns block_m/consumers rows "
                                          "(swap_ab: block_n/consumers columns)")
    raster_group: int = Field(8, ge=1, le=64, description="tile-rows a block group walks before moving across N "
                              "(raster_along n: tile-columns before moving down M)")
    raster_along: Literal["m", "n"] = Field(
        "m", description="the dimension consecutive tiles group along: m (GROUP tile-rows down each column; B is "
        "read again once per group) or n (GROUP tile-columns along each row; A is read again once per group)")
    raster_snake: bool = Field(
        False, description="every other group of tiles walks back the way the last one came, so that its first "
        "tiles reuse the panels the last group's final tiles left in L2")
    min_blocks: Literal[1, 2] = Field(1, description="blocks resident per SM (__launch_bounds__); caps registers")
    # smem by default (docs/decisions.md `default-epilogue-loader`)
    epilogue: Literal["direct", "smem", "tma"] = Field(
        "smem", description="smem: C staged in shared memory for 16-byte stores; direct: 4-byte stores from the "
        "accumulators; tma: C staged in 128-byte-swizzled panels and written by asynchronous TMA stores (block_n a "
        "multiple of 64), so a persistent block's next tile starts while the last one drains")
    persistent: bool = Field(False, description="one block per SM slot striding over the tiles; the producer "
                             "prefetches the next tile while the consumers store the last")
    # tma by default (docs/decisions.md `default-epilogue-loader`)
    loader: Literal["cp_async", "tma"] = Field(
        "tma", description="how the producer fills the ring: tma = one thread issuing cp.async.bulk.tensor copies "
        "from host-encoded tensor maps (zero-filled past the edges); cp_async = 128 threads of 16-byte cp.async "
        "copies")
    split_k: Literal[1, 2, 4, 8] = Field(
        1, description="CTAs per C tile, each over its own contiguous K range (whole block_k tiles), launched as a "
        "thread-block cluster along grid x; they sum their fp32 partial tiles through distributed shared memory "
        "(each CTA a block_m/split_k row slice, peers in a fixed order: deterministic) and store C. For long-K "
        "problems with few C tiles; 1 = no split, no cluster")
    k_groups: int = Field(
        1, ge=1, le=8, description="CTAs (or split_k clusters) per C tile beyond a cluster, each over its own K "
        "range: they write fp32 partial tiles to a global workspace and the last to arrive at a tile (an atomic "
        "counter it resets) sums them in group order (deterministic) and stores C. Fills the SMs where the C "
        "tiles are few, without the placement limits of large clusters; 1 = none")

    cluster_m: Literal[1, 2] = Field(
        1, description="CTAs of a thread-block cluster on vertically adjacent C tiles: each loads 1/cluster_m of "
        "every B tile and TMA-multicasts it to all of them (B read from L2 once per cluster); a stage is refilled "
        "once every CTA's consumers released it. TMA loader, one tile per CTA (K groups may split its K, a pair "
        "sharing one K range; persistent: the pair strides over pairs of C tiles together); 1 = no cluster")

    cluster_n: Literal[1, 2, 4] = Field(
        1, description="CTAs of a thread-block cluster on horizontally adjacent C tiles (same rows): each loads "
        "1/cluster_n of every A tile's rows and TMA-multicasts them to all (A read from L2 once per cluster), as "
        "cluster_m does for B; for few tiles of rows and many of columns (a swapped tile of M's rows split along N). "
        "TMA loader, split_k 1, cluster_m 1, persistent only in pairs; 1 = no cluster")

    ping_pong: bool = Field(
        False, description="persistent blocks of two consumer warpgroups that each own whole block_m x block_n "
        "tiles, the block's tiles taken in turn: one stores its tile (C staged in an area of its own) while the other "
        "multiplies the next, so the tensor cores do not wait on the epilogue; for many tiles of a short K. Each "
        "consumer holds a whole tile's accumulators (block_m x block_n / 128 registers a thread)")

    c_panels: bool = Field(
        False, description="with epilogue tma (not swapped): C staged one 64-column panel at a time through two "
        "panel buffers a consumer warpgroup (one drains by TMA store while the next fills), not a whole tile: "
        "2 x 64 columns of shared memory a row instead of block_n, so a persistent block keeps a deeper ring "
        "(128 x 256 with 4 stages, 256-row tiles); measured no faster than whole-tile stores on large shapes, and a "
        "residual with it loads R into registers")

    tail_split: bool = Field(
        False, description="persistent: each tile of a part-filled last round is cut along K into the ranges (2-8, "
        "of 4+ k-tiles) that end it soonest, dealt out like tiles and summed through a workspace by the last to "
        "arrive; no clusters or ping-pong")

    mixed_tail: bool = Field(
        False, description="persistent 128 x 256: the last tile-rows in 192-column tiles, as many as end a "
        "part-filled last round soonest (TMA stores; no clusters, ping_pong, tail_split or gated epilogue)")

    b_panels: bool = Field(
        False, description="B in kn layout with block_n not a multiple of 64 (176, 240, ...): B's stage holds whole "
        "64-column panels (block_n rounded up to 64), one 4-D TMA copy a stage from any column that is a multiple "
        "of 16 (the last column tile: a 2-D copy a panel); needs loader tma, no multicast along M, no swap_ab; "
        "measured no faster than the 64-column multiples (its rows start mid-line), slower on most large shapes")

    swap_ab: bool = Field(
        False, description="wgmma computes C^T = B^T A^T, the B tile (block_n rows, 64 per m64 wgmma, block_n / "
        "consumers per consumer) as wgmma's A operand and the A tile as its B operand (wgmma N = block_m, any "
        "multiple of 16), so rows of A are not padded to 64: tiny M (a 16-row A), or M just past a multiple of 64 "
        "(205 rows in one 208-row tile, not 256); the accumulators hold C transposed, written back through shared "
        "memory (smem epilogue, tma epilogue in 16-row chunks, or the split-K exchange tile)")

    @model_serializer(mode="wrap")
    def _without_defaults_of_later_fields(self, handler: Any) -> dict[str, Any]:
        """The LATER_FIELDS (ping_pong, raster_along, raster_snake, c_panels, ...) appear only where they differ from
        their defaults: every other setting keeps the dict, and so the candidate id and the tuning database rows, it
        had before they existed."""
        out = handler(self)
        for name, default in LATER_FIELDS.items():
            if out.get(name) == default:
                out.pop(name, None)
        return out

    @property
    def row_owners(self) -> int:
        """Consumer warpgroups that split a tile's wgmma rows: all of them, or one (ping-pong: whole tiles each)."""
        return 1 if self.ping_pong else self.consumers

    @property
    def wgmma_m(self) -> int:
        """The tile's extent along wgmma's M (rows of the accumulators): block_m, or block_n where swapped."""
        return self.block_n if self.swap_ab else self.block_m

    @property
    def wgmma_n(self) -> int:
        return self.block_m if self.swap_ab else self.block_n

    @property
    def narrow_n(self) -> int:
        """mixed_tail: the columns of a narrow tile (3/4 of block_n)."""
        return self.block_n * 3 // 4

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def ring_bytes(self) -> int:
        return self.stages * (self.block_m + self.b_columns) * self.block_k * 2

    @property
    def b_columns(self) -> int:
        """Columns of B a stage holds: block_n, or with b_panels whole 64-column panels."""
        return ceil_div(self.block_n, 64) * 64 if self.b_panels else self.block_n

    @property
    def reduces(self) -> bool:
        """Partial tiles are summed (split_k or k_groups > 1): the kernel stores C from fp32 sums, not the epilogue."""
        return self.split_k > 1 or self.k_groups > 1

    @property
    def residual_panels(self) -> bool:
        """A residual epilogue's R comes by TMA into the C staging panels (a persistent block's before the tile's
        mainloop), added there before the TMA store: whole tiles stored through TMA, not swapped. Otherwise each
        thread loads its accumulators' R values from global memory after the mainloop."""
        return (self.epilogue == "tma" and not self.swap_ab and not self.reduces and not self.c_panels
                and not self.tail_split)

    @property
    def exchange_bytes(self) -> int:
        """The fp32 partial tile (rows padded by 8 floats) written over the drained ring where partials are summed."""
        return self.block_m * (self.block_n + 8) * 4 if self.reduces else 0

    @property
    def smem_bytes(self) -> int:
        # swapped TMA stores go out in chunks of rows through two buffers a warpgroup: 2 chunks x block_n halves
        # and c_panels: two 64-column panels a warpgroup
        tma = (2 * SWAP_C_CHUNK * self.block_n * 2 if self.swap_ab else 2 * self.block_m * 64 * 2 if self.c_panels
               else self.block_m * self.block_n * 2)
        c_tile = {"smem": self.block_m * (self.block_n + 8) * 2, "tma": tma, "direct": 0}[self.epilogue]
        c_tile *= self.consumers if self.ping_pong else 1  # ping-pong: a tile's area per consumer
        c_tile = max(c_tile, self.exchange_bytes)
        # Persistent blocks refill the ring while storing C, so C needs room of its own; otherwise it reuses it.
        body = self.ring_bytes + c_tile if self.persistent else max(self.ring_bytes, c_tile)
        # + the mbarriers (16 B a stage; ping-pong: two more) + slack to align the ring to a 1024-byte swizzle atom
        return body + 16 * self.stages + (16 if self.ping_pong else 0) + 1024

    @property
    def entry_regs(self) -> int:
        """The per-thread register cap __launch_bounds__(threads, min_blocks) gives ptxas."""
        regs = LIMITS.regs_per_sm // (self.threads * self.min_blocks)
        return 255 if regs >= 256 else regs // 8 * 8

    @property
    def set_maxnreg(self) -> bool:
        """Move registers from the producer to the consumers where the entry cap is short. With min_blocks > 1
        ptxas (NVRTC 13) still holds the consumer code to the entry cap (C7602), so there it would buy nothing."""
        return self.min_blocks == 1 and self.entry_regs < 240

    @property
    def producer_regs(self) -> int:
        if not self.set_maxnreg:
            return self.entry_regs
        if self.loader == "tma":
            return TMA_PRODUCER_REGS
        need = ceil_div(self.accumulators + CONSUMER_OVERHEAD, 8) * 8
        spare = (self.threads * self.entry_regs - 128 * self.consumers * need) // 128 // 8 * 8
        return max(PRODUCER_REGS_MIN, min(PRODUCER_REGS_MAX, spare))

    @property
    def consumer_regs(self) -> int:
        if not self.set_maxnreg:
            return self.entry_regs
        pool = self.threads * self.entry_regs - 128 * self.producer_regs
        return min(240, pool // (128 * self.consumers) // 8 * 8)

    @property
    def accumulators(self) -> int:
        """fp32 accumulator registers per consumer thread."""
        return self.wgmma_m // self.row_owners // 64 * self.wgmma_n // 2

    @model_validator(mode="after")
    def _feasible(self) -> Sm90WgmmaParams:
        if self.swap_ab and (self.block_n % 64 or self.epilogue == "direct"):
            raise ValueError(f"swap_ab: block_n={self.block_n} must be a multiple of 64 (the m64 wgmma rows), with "
                             f"epilogue smem or tma (not {self.epilogue}: C is transposed through shared memory)")
        if not self.swap_ab and self.block_m % 64:
            raise ValueError(f"block_m={self.block_m}: without swap_ab the rows are m64 wgmmas (64, 128, 192 or "
                             "256); other multiples of 16 need swap_ab")
        if self.ping_pong and (not self.persistent or self.consumers != 2 or self.swap_ab or self.reduces
                              or self.cluster_m * self.cluster_n > 1):
            raise ValueError("ping_pong: two consumer warpgroups taking whole tiles in turn need persistent=True, "
                             f"consumers=2 (not {self.consumers}), and no swap_ab, split_k, k_groups or clusters")
        if self.wgmma_m % (64 * self.row_owners):
            extent = f"block_n={self.block_n} (swap_ab)" if self.swap_ab else f"block_m={self.block_m}"
            raise ValueError(f"{extent} must split into consumers={self.consumers} warpgroups of a multiple of 64 "
                             "rows each (wgmma is m64)")
        if self.epilogue == "tma" and (self.block_n % 64 or self.reduces):
            raise ValueError(f"epilogue=tma stores 64-column panels: block_n={self.block_n} must be a multiple of "
                             f"64, and split_k={self.split_k}, k_groups={self.k_groups} must be 1 (split-K stores "
                             "its own sums)")
        if self.c_panels and (self.epilogue != "tma" or self.swap_ab):
            raise ValueError("c_panels stages C for TMA stores one panel at a time: it needs epilogue=tma and no "
                             "swap_ab (swapped TMA stores already go out in chunks of rows)")
        if self.cluster_m > 1 and (self.loader != "tma" or self.split_k > 1 or self.block_n % (64 * self.cluster_m)):
            raise ValueError(f"cluster_m={self.cluster_m} multicasts whole 64-column B panels from TMA copies in "
                             "clusters of one C tile per CTA at a time: it needs loader=tma, block_n a multiple of "
                             f"{64 * self.cluster_m}, split_k 1 (K groups may split K)")
        # (a CTA's share of A's rows, a multiple of 4 rows of 128 bytes, may start inside a swizzle atom: TMA and
        # wgmma both swizzle by address)
        if self.cluster_n > 1 and (self.loader != "tma" or self.split_k > 1 or self.cluster_m > 1):
            raise ValueError(f"cluster_n={self.cluster_n} multicasts A's rows from TMA copies: it needs loader=tma, "
                             "split_k 1 and cluster_m 1 (one axis of multicast)")
        if self.persistent and self.cluster_n > 2:
            raise ValueError(f"cluster_n={self.cluster_n} with persistent blocks: a persistent grid fills every SM, "
                             "but fewer clusters of 4 run at once (30 of 33 on the H200), so the rest would wait a "
                             "whole wave")
        if self.b_panels and (self.block_n % 64 == 0 or self.loader != "tma" or self.cluster_m > 1 or self.swap_ab):
            raise ValueError(f"b_panels copies whole 64-column panels of a kn B for a block_n that is not a multiple "
                             f"of 64 (not {self.block_n}): it needs loader=tma, cluster_m 1 and no swap_ab")
        if self.tail_split and (not self.persistent or self.ping_pong or self.cluster_m * self.cluster_n > 1):
            raise ValueError("tail_split cuts the last round of a persistent grid's tiles: it needs persistent=True, "
                             "no ping_pong and no clusters (cluster_m = cluster_n = 1)")
        if self.mixed_tail and (not self.persistent or self.block_n != 256 or self.epilogue != "tma" or self.c_panels
                                or self.swap_ab or self.ping_pong or self.tail_split or self.loader != "tma"
                                or self.cluster_m * self.cluster_n > 1):
            raise ValueError("mixed_tail cuts a persistent grid's last tile-rows into 192-column tiles of a 256-column "
                             "tiling: it needs persistent=True, block_n 256, loader and epilogue tma (whole-tile "
                             "stores), and no c_panels, swap_ab, ping_pong, tail_split or clusters")
        if self.reduces and self.persistent:
            raise ValueError(f"split_k={self.split_k}, k_groups={self.k_groups}: split-K needs one tile per CTA, so "
                             "persistent blocks are not supported with it")
        if self.smem_bytes > LIMITS.smem_per_block:
            c_note = " + C staging beside it (persistent)" if self.persistent and self.epilogue != "direct" else ""
            x_note = (f", or the split-K fp32 exchange tile of {self.exchange_bytes} B if larger"
                      if self.split_k > 1 else "")
            cols = "b_columns" if self.b_panels else "block_n"
            raise ValueError(f"shared memory {self.smem_bytes} B (ring of stages*(block_m+{cols})*128 B{c_note}"
                             f"{x_note} + barriers + alignment) exceeds the sm_90 limit of {LIMITS.smem_per_block} B "
                             "per block")
        if self.min_blocks * (self.smem_bytes + LIMITS.smem_reserved_per_block) > LIMITS.smem_per_sm:
            raise ValueError(f"min_blocks={self.min_blocks} blocks of {self.smem_bytes} B shared memory do not fit "
                             f"one SM ({LIMITS.smem_per_sm} B)")
        if self.wgmma_n // 2 + WGMMA_EXTRA > self.entry_regs:
            raise ValueError(f"one m64n{self.wgmma_n} wgmma needs {self.wgmma_n // 2 + WGMMA_EXTRA} registers within "
                             f"the entry cap of {self.entry_regs} ({self.threads} threads x min_blocks="
                             f"{self.min_blocks}): use a smaller block_n or fewer threads")
        if self.accumulators + CONSUMER_OVERHEAD > self.consumer_regs:
            raise ValueError(f"{self.accumulators} accumulator registers per consumer thread (+{CONSUMER_OVERHEAD}) "
                             f"exceed the {self.consumer_regs} a consumer gets with {self.threads} threads x "
                             f"min_blocks={self.min_blocks}: use a smaller block_n or more consumers"
                             + (" or min_blocks=1" if self.min_blocks > 1 else ""))
        return self



def launched_tiles(p: Sm90WgmmaParams, problem: Problem) -> int:
    """C tiles the launch covers: whole multicast clusters along M or N (a trailing CTA past M or N still loads its
    share of B or A for its peers)."""
    return (ceil_div(problem.m, p.block_m * p.cluster_m) * p.cluster_m
            * ceil_div(problem.n, p.block_n * p.cluster_n) * p.cluster_n)


# Tail split (rendered into the kernel, whose tail_cut this restates): at most TAIL_PARTS K ranges a tail tile, each of
# TAIL_MIN_K+ k-tiles, one range a CTA (a single short round; the workspace holds one partial tile a CTA). A cut round
# takes its longest range plus TAIL_FILL k-tiles (the ring's fill, the partials' stores and fence) plus TAIL_SUM a
# range (the summing CTA's read of each partial): fitted to the measured cuts (docs/decisions.md `tail-split`).
TAIL_PARTS, TAIL_MIN_K, TAIL_FILL, TAIL_SUM = 8, 4, 14, 3


def tail_cut(tiles: int, grid: int, k_tiles: int) -> tuple[int, float]:
    """How the kernel cuts a part-filled last round of `tiles` on `grid` CTAs: the K ranges a tail tile is cut into,
    and how long the round then takes as a share of a tile's time. The cut, one range a CTA, whose round ends soonest
    (ceil(k_tiles / p) + TAIL_FILL + p x TAIL_SUM k-tiles), the fewest ranges on a tie; (1, 1.0) where no cut ends
    sooner than a whole tile, (1, 0.0) where the rounds are whole."""
    rest = tiles % grid
    best = (1, k_tiles if rest else 0)
    for p in range(2, TAIL_PARTS + 1):
        if not rest or p * TAIL_MIN_K > k_tiles or rest * p > grid:
            break
        cost = ceil_div(k_tiles, p) + TAIL_FILL + p * TAIL_SUM
        if cost < best[1]:
            best = (p, cost)
    return best[0], best[1] / k_tiles


# Mixed tail (rendered into the kernel, whose mixed_rows this restates): a narrow tile (3/4 of block_n) takes
# NARROW_COST of a wide one's time, and narrow rows are cut only where the busiest CTA ends MIXED_GAIN of a wide tile
# sooner, and at least NARROW_ROWS_MIN rows, so that each B slab serves as many narrow tiles (one row read B from DRAM a
# tile: 2048 x 28672 x 4096 4.5% slower) (docs/decisions.md `mixed-tail`).
NARROW_COST, MIXED_GAIN, NARROW_ROWS_MIN = 0.85, 0.1, 4


def mixed_rows(tiles_m: int, tiles_n: int, tiles_nn: int, grid: int) -> tuple[int, float]:
    """How many of the last of tiles_m tile-rows the kernel puts in narrow tiles (tiles_nn a row, against tiles_n
    wide ones) on a grid of `grid` CTAs, each dealt every grid-th unit of the wide tiles and then the narrow ones;
    and the busiest CTA's work in wide tiles. The fewest rows (NARROW_ROWS_MIN or more) whose busiest CTA ends
    soonest, where that is MIXED_GAIN sooner than with none; (0, whole rounds) otherwise."""
    def busiest(rows: int) -> float:
        wide, narrow = (tiles_m - rows) * tiles_n, rows * tiles_nn
        full, rest = divmod(wide, grid)
        t = full + NARROW_COST * ceil_div(narrow, grid)  # a CTA past the wide remainder: its narrow tiles come first
        if rest:  # one with a wide tile more takes the narrow ones dealt after the first grid - rest
            t = max(t, full + 1 + NARROW_COST * ceil_div(max(0, narrow - (grid - rest)), grid))
        return t
    best, best_t = 0, ceil_div(tiles_m * tiles_n, grid) - MIXED_GAIN
    for rows in range(NARROW_ROWS_MIN, tiles_m + 1):
        if (t := busiest(rows)) < best_t:
            best, best_t = rows, t
    return best, (best_t if best else float(ceil_div(tiles_m * tiles_n, grid)))


def launch_plan(p: Sm90WgmmaParams, problem: Problem, device: DeviceFacts) -> LaunchPlan:
    """How p launches for the problem on the device: one tile a CTA, or its K split over split_k x k_groups CTAs
    (split_k of them a cluster), whole multicast clusters; persistent: as many blocks as the SMs hold at once."""
    return LaunchPlan(tiles=launched_tiles(p, problem), tile_ctas=p.split_k * p.k_groups,
                      cluster=p.split_k * p.cluster_m * p.cluster_n, min_blocks=p.min_blocks,
                      persistent=p.persistent, smem_bytes=p.smem_bytes, threads=p.threads, device=device)


def deepest(fields: dict[str, Any], top: int = 8) -> Sm90WgmmaParams | None:
    """The setting `fields` describes with the deepest ring (at most `top` stages) that fits; None if none does."""
    for stages in range(top, 1, -1):
        try:
            return Sm90WgmmaParams(**{**fields, "stages": stages})
        except ValueError:
            continue
    return None


def with_update(p: Sm90WgmmaParams, update: dict[str, Any]) -> Sm90WgmmaParams | None:
    """p changed by `update`, with the deepest ring (at most p's) that still fits; None if none does."""
    return deepest({**p.model_dump(), **update}, top=p.stages)


