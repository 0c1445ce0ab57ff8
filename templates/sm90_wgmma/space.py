"""Parameter space, launch rule and search seeds of the sm90_wgmma family (a producer + wgmma consumers).

One producer warpgroup fills a STAGES-deep ring of 128-byte-swizzled tiles with cp.async or TMA (mbarrier
completion); CONSUMERS warpgroups each own block_m / consumers rows of the C tile and run wgmma.mma_async
m64n{block_n}k16 (with swap_ab, for tiny M, one consumer owns the tile transposed: m64 per 64 columns, n{block_m}).
With TMA the launch rule declares the tensor maps the host encodes; with K groups, the workspace and arrival counters
the host passes after them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from core.records import LaunchSpec, Problem, TensorMapSpec
from templates.family import SMEM_PER_BLOCK_MAX, Family, Params

SMS = 132  # H200; the ranking only needs a rough wave count
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024  # the driver's own share of each block's shared memory on sm_90
REGS_PER_SM = 65536
# The cp.async producer needs few registers (72 leave the persistent kn 256-row loop without spills); setmaxnreg hands
# the rest to the consumers, and the producer gives up more where the consumers need it.
PRODUCER_REGS_MAX, PRODUCER_REGS_MIN = 80, 56
TMA_PRODUCER_REGS = 40  # one thread issuing TMA copies needs few registers
WGMMA_EXTRA = 26  # ptxas (C7602) wants one m64nN wgmma's N/2 accumulators + 26 within the entry register cap
# Consumer registers beyond the accumulators (descriptors, loop state, addresses): ptxas asks for 26 more than the
# accumulators of one wgmma (C7602 "register target of ..."); a little slack for the epilogue.
CONSUMER_OVERHEAD = 32


class Sm90WgmmaParams(Params):
    block_m: Literal[16, 32, 48, 64, 128, 192, 256] = Field(
        128, description="rows of C per thread block (16-48 only with swap_ab)")
    block_n: int = Field(256, ge=16, le=256, multiple_of=16,
                         description="columns of C per block = the wgmma N (kn layout: a multiple of 64)")
    block_k: Literal[64] = Field(64, description="K slice per stage: 64 fp16 = one 128-byte swizzle row")
    stages: int = Field(4, ge=2, le=12, description="depth of the shared-memory ring")
    consumers: Literal[1, 2, 3, 4] = Field(2, description="consumer warpgroups; each owns block_m/consumers rows")
    raster_group: int = Field(8, ge=1, le=64, description="tile-rows a block group walks before moving across N")
    min_blocks: Literal[1, 2] = Field(1, description="blocks resident per SM (__launch_bounds__); caps registers")
    epilogue: Literal["direct", "smem", "tma"] = Field(
        "smem", description="smem: C staged in shared memory for 16-byte stores (measured 3-10% faster on the "
        "H200 than direct); direct: 4-byte stores from the accumulators; tma: C staged in 128-byte-swizzled "
        "panels and written by asynchronous TMA stores (block_n a multiple of 64), so a persistent block's "
        "next tile starts while the last one drains")
    persistent: bool = Field(False, description="one block per SM slot striding over the tiles; the producer "
                             "prefetches the next tile while the consumers store the last")
    loader: Literal["cp_async", "tma"] = Field(
        "tma", description="how the producer fills the ring: tma = one thread issuing cp.async.bulk.tensor copies "
        "from host-encoded tensor maps (zero-filled past the edges; measured 13-25% faster on the H200 at 1024-8192 "
        "cubed); cp_async = 128 threads of 16-byte cp.async copies")
    split_k: Literal[1, 2, 4, 8] = Field(
        1, description="CTAs per C tile, each over its own contiguous K range (whole block_k tiles), launched as a "
        "thread-block cluster along grid x; they sum their fp32 partial tiles through distributed shared memory "
        "(each CTA a block_m/split_k row slice, peers in a fixed order: deterministic) and store fp16 C. For long-K "
        "problems with few C tiles; 1 = no split, no cluster")
    k_groups: int = Field(
        1, ge=1, le=8, description="CTAs (or split_k clusters) per C tile beyond a cluster, each over its own K "
        "range: they write fp32 partial tiles to a global workspace and the last to arrive at a tile (an atomic "
        "counter it resets) sums them in group order (deterministic) and stores fp16 C. Fills the SMs where the C "
        "tiles are few, without the placement limits of large clusters; 1 = none")

    cluster_m: Literal[1, 2] = Field(
        1, description="CTAs of a thread-block cluster on vertically adjacent C tiles: each loads 1/cluster_m of "
        "every B tile and TMA-multicasts it to all of them (B read from L2 once per cluster); a stage is refilled "
        "once every CTA's consumers released it. TMA loader, one tile per CTA; 1 = no cluster")

    swap_ab: bool = Field(
        False, description="for tiny M: wgmma computes C^T = B^T A^T, the B tile (block_n rows, 64 per m64 wgmma) "
        "as wgmma's A operand and the A tile as its B operand (wgmma N = block_m, from 16), so a 16-row A is not "
        "padded to 64 wgmma rows; the accumulators hold C transposed, written back through shared memory (smem "
        "epilogue or the split-K exchange tile). One consumer warpgroup, no multicast")

    @property
    def wgmma_m(self) -> int:
        """The tile's extent along wgmma's M (rows of the accumulators): block_m, or block_n where swapped."""
        return self.block_n if self.swap_ab else self.block_m

    @property
    def wgmma_n(self) -> int:
        return self.block_m if self.swap_ab else self.block_n

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def ring_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * self.block_k * 2

    @property
    def reduces(self) -> bool:
        """Partial tiles are summed (split_k or k_groups > 1): the kernel stores C from fp32 sums, not the epilogue."""
        return self.split_k > 1 or self.k_groups > 1

    @property
    def exchange_bytes(self) -> int:
        """The fp32 partial tile (rows padded by 8 floats) written over the drained ring where partials are summed."""
        return self.block_m * (self.block_n + 8) * 4 if self.reduces else 0

    @property
    def smem_bytes(self) -> int:
        c_tile = {"smem": self.block_m * (self.block_n + 8) * 2, "tma": self.block_m * self.block_n * 2,
                  "direct": 0}[self.epilogue]
        c_tile = max(c_tile, self.exchange_bytes)
        # Persistent blocks refill the ring while storing C, so C needs room of its own; otherwise it reuses it.
        body = self.ring_bytes + c_tile if self.persistent else max(self.ring_bytes, c_tile)
        # + the mbarriers (16 B a stage) + slack to align the ring to a 1024-byte swizzle atom
        return body + 16 * self.stages + 1024

    @property
    def entry_regs(self) -> int:
        """The per-thread register cap __launch_bounds__(threads, min_blocks) gives ptxas."""
        regs = REGS_PER_SM // (self.threads * self.min_blocks)
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
        need = -(-(self.accumulators + CONSUMER_OVERHEAD) // 8) * 8
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
        return self.wgmma_m // self.consumers // 64 * self.wgmma_n // 2

    @model_validator(mode="after")
    def _feasible(self) -> Sm90WgmmaParams:
        if self.swap_ab and (self.block_n % 64 or self.consumers != 1 or self.epilogue != "smem"
                             or self.cluster_m != 1):
            raise ValueError(f"swap_ab: block_n={self.block_n} must be a multiple of 64 (the m64 wgmma rows), with "
                             f"consumers=1 (not {self.consumers}), epilogue=smem (not {self.epilogue}: C is "
                             f"transposed through shared memory) and cluster_m=1 (not {self.cluster_m})")
        if not self.swap_ab and self.block_m < 64:
            raise ValueError(f"block_m={self.block_m}: tiles under 64 rows need swap_ab (wgmma is m64)")
        if self.wgmma_m % (64 * self.consumers):
            raise ValueError(f"block_m={self.block_m} must split into consumers={self.consumers} warpgroups of "
                             "a multiple of 64 rows each (wgmma is m64)")
        if self.epilogue == "tma" and (self.block_n % 64 or self.reduces):
            raise ValueError(f"epilogue=tma stores 64-column panels: block_n={self.block_n} must be a multiple of "
                             f"64, and split_k={self.split_k}, k_groups={self.k_groups} must be 1 (split-K stores "
                             "its own sums)")
        if self.cluster_m > 1 and (self.loader != "tma" or self.persistent or self.reduces
                                   or self.block_n % (64 * self.cluster_m)):
            raise ValueError(f"cluster_m={self.cluster_m} multicasts whole 64-column B panels from TMA copies in "
                             "clusters of one tile per CTA: it needs loader=tma, block_n a multiple of "
                             f"{64 * self.cluster_m}, no persistent blocks, split_k and k_groups 1")
        if self.reduces and self.persistent:
            raise ValueError(f"split_k={self.split_k}, k_groups={self.k_groups}: split-K needs one tile per CTA, so "
                             "persistent blocks are not supported with it")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            c_note = " + C staging beside it (persistent)" if self.persistent and self.epilogue != "direct" else ""
            x_note = (f", or the split-K fp32 exchange tile of {self.exchange_bytes} B if larger"
                      if self.split_k > 1 else "")
            raise ValueError(f"shared memory {self.smem_bytes} B (ring of stages*(block_m+block_n)*128 B{c_note}"
                             f"{x_note} + barriers + alignment) exceeds the sm_90 limit of {SMEM_PER_BLOCK_MAX} B "
                             "per block")
        if self.min_blocks * (self.smem_bytes + SMEM_RESERVED_PER_BLOCK) > SMEM_PER_SM:
            raise ValueError(f"min_blocks={self.min_blocks} blocks of {self.smem_bytes} B shared memory do not fit "
                             f"one SM ({SMEM_PER_SM} B)")
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


# (block_m, block_n, consumers), from the large-problem favourites down to small-problem shapes.
TILES = [
    (128, 256, 2), (256, 128, 2), (128, 192, 2), (256, 192, 2), (128, 128, 2), (192, 128, 3), (256, 64, 2),
    (128, 64, 2), (128, 128, 1), (64, 256, 1), (64, 192, 1), (64, 128, 1), (64, 64, 1),
    (128, 224, 2), (128, 160, 2), (128, 96, 2), (64, 96, 1), (64, 48, 1), (64, 32, 1), (64, 16, 1),
]


def _cost(p: Sm90WgmmaParams, problem: Problem) -> float:
    """Relative time: waves of resident blocks times a tile's work, inflated by its traffic and fixed costs."""
    tiles = -(-problem.m // p.block_m) * -(-problem.n // p.block_n)
    waves = -(-tiles // (SMS * p.min_blocks))
    per_sm = min(p.min_blocks, -(-tiles // SMS))
    k_tiles = -(-problem.k // p.block_k)
    traffic = 1 + 40 / p.block_m + 40 / p.block_n
    # Two consumer warpgroups per SM measured best on the H200 (three: 3-15% slower; one leaves gaps between wgmma
    # groups); the ring fills once per tile.
    issue = {2: 1.0, 3: 1.06}.get(per_sm * p.consumers, 1.1)
    # kn with block_n = 192: B rows of 24 chunks leave producer threads idle; measured 5-20% slower on the H200.
    uneven = 1.15 if problem.b_layout == "kn" and 128 % (p.block_n // 8) else 1.0
    return waves * per_sm * p.block_m * p.block_n * traffic * issue * uneven * (k_tiles + 2 + 2 / p.stages)


# Clusters of 8, 4, 2 CTAs that run at once per CTA slot of an SM: clusters must fit inside one GPC, so the 132 SMs
# hold fewer than 132 / size (64x64 tiles, split_k=8, 1 block per SM: 16 clusters measured clearly slower per CTA
# than 8 or 11 on the H200; 32 clusters of 4 ran on 120 SMs, the last 2 clusters in a second wave).
CLUSTERS_PER_SLOT = {2: 66, 4: 30, 8: 14}


def _split_cost(p: Sm90WgmmaParams, problem: Problem) -> float:
    """Relative time of a split-K setting. These problems stream operands: a CTA's k-tile costs the slower of its
    wgmma issue (~bm*bn/16 clocks) and its cp.async loads (~4 clocks a 128-byte row of A or B: the rate measured
    per SM on the H200), CTAs sharing an SM share its load rate, and clusters beyond what fits run in a second wave.
    Calibrated on 64_1024_16384 and 256_128_16384 (both layouts): it ranks the measured best first."""
    tiles = -(-problem.m // p.block_m) * -(-problem.n // p.block_n)
    slots = min(SMEM_PER_SM // (p.smem_bytes + SMEM_RESERVED_PER_BLOCK), 2048 // p.threads)
    cap = CLUSTERS_PER_SLOT[p.split_k]
    waves = -(-tiles // (cap * slots))
    sharing = min(slots, -(-tiles // cap))  # CTAs of one SM that load at once
    k_share = -(-problem.k // (p.block_k * p.split_k))
    per_k_tile = max(p.block_m * p.block_n / 16, 4 * (p.block_m + p.block_n) * sharing)
    return waves * ((k_share + 2) * per_k_tile + p.block_m * p.block_n / 16)


def _split_settings(problem: Problem) -> list[Sm90WgmmaParams]:
    """Split-K settings for long-K problems with few C tiles (K >= 8 max(M, N)), best guesses first: every tile shape
    with split_k 8 or 4 (tiles x split_k within two waves of CTAs, every CTA at least 16 k-tiles), with the deepest
    ring that fits and with a 4-stage ring (several CTAs per SM); none for other problems."""
    k_tiles = -(-problem.k // 64)
    if problem.k < 8 * max(problem.m, problem.n) or k_tiles < 32:
        return []
    found: list[Sm90WgmmaParams] = []
    for bm, bn, consumers in TILES:
        if (problem.b_layout == "kn" and bn % 64) or bm > -(-problem.m // 64) * 64 or bn > -(-problem.n // 64) * 64:
            continue  # kn needs 64-column panels; rows or columns past M, N would be computed for nothing
        tiles = -(-problem.m // bm) * -(-problem.n // bn)
        if tiles >= SMS // 2:
            continue
        for split in (8, 4):
            if tiles * split > 2 * SMS or k_tiles // split < 16 or tiles * split < 32:
                continue
            for rings in ((8, 6, 5), (4,)):  # the deepest that fits; a shallow one
                for stages in rings:
                    try:
                        found.append(Sm90WgmmaParams(block_m=bm, block_n=bn, consumers=consumers, stages=stages,
                                                     split_k=split))
                        break
                    except ValueError:
                        continue
    found.sort(key=lambda p: _split_cost(p, problem))
    return found[:12]


def _group_settings(problem: Problem) -> list[Sm90WgmmaParams]:
    """K-group settings for skinny problems (M <= 64) whose 64-row tiles fill at most half the SMs: 64 x 64, 128, 256
    tiles with k_groups = as many CTAs per tile as one wave holds (at most 8, each CTA at least 16 k-tiles), the
    deepest ring that fits; none for other problems. Measured on the H200: 64_4096_16384 64x64 with 2 groups
    1.03-1.14x of cuBLAS (the best single-CTA tiles 0.91-1.03x), 16_4096_4096 64x128 with 4 groups 0.80-0.96x
    (0.45-0.69x); on M = 128-1024 the fp32 partials cost more than the extra SMs bring (0.33-0.77x).
    Two CTAs a tile go first as a cluster pair (split_k=2), whose sum through distributed shared memory costs less
    than the workspace: 64_4096_16384 64x64 37.6 against 38.6 us kn, 39.1 against 40.2 us nk."""
    k_tiles = -(-problem.k // 64)
    if problem.m > 64 or -(-problem.n // 64) > SMS // 2:
        return []
    found = []
    for bn in (64, 128, 256):
        tiles = -(-problem.n // bn)
        groups = min(8, SMS // tiles)
        if bn > -(-problem.n // 64) * 64 or groups < 2 or k_tiles // groups < 16:
            continue
        ways = ([{"split_k": 2}] if groups == 2 else []) + [{"k_groups": groups}]
        for way in ways:
            v = deepest({"block_m": 64, "block_n": bn, "consumers": 1, **way})
            if v is not None:
                found.append(v)
    return found


def _swap_settings(problem: Problem) -> list[Sm90WgmmaParams]:
    """Swapped-role settings for tiny M (at most 48 rows: block_m = M rounded up to 16), block_n 64, 128, 256, the
    deepest ring that fits (up to 12 stages: the tiles are small; two CTAs an SM where the tiles outnumber the SMs).
    Where the tiles fill fewer than half the SMs and K is long, each tile's K is split over as many CTAs as one wave
    holds (at most 8, each CTA at least 16 k-tiles): in one cluster where that many clusters run at once, in K
    groups, and in pairs of K groups; none for other problems."""
    if problem.m > 48:
        return []
    k_tiles = -(-problem.k // 64)
    bm = -(-problem.m // 16) * 16
    found = []
    for bn in (64, 128, 256):
        tiles = -(-problem.n // bn)
        if bn > -(-problem.n // 64) * 64:
            continue
        parts = min(8, SMS // tiles)
        ways: list[dict[str, int]] = [{"min_blocks": 2}] if tiles > SMS else [{}]  # two CTAs an SM: one wave
        if tiles < SMS // 2 and k_tiles // parts >= 16:
            ways = [{"split_k": parts}] if tiles <= CLUSTERS_PER_SLOT.get(parts, 0) else []
            ways += [{"k_groups": parts}] + ([{"split_k": 2, "k_groups": parts // 2}] if parts >= 4 else [])
        elif tiles < SMS // 2 and bn > 64:
            continue  # few tiles and K too short to split: only the smallest tile, the most CTAs
        for way in ways:
            v = deepest({"block_m": bm, "block_n": bn, "consumers": 1, "swap_ab": True, **way}, top=12)
            if v is not None:
                found.append(v)
    return found


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


class Sm90Wgmma(Family):
    name: ClassVar[str] = "sm90_wgmma"
    arches: ClassVar[tuple[str, ...]] = ("sm_90a",)
    params_model: ClassVar[type[Params]] = Sm90WgmmaParams
    description: ClassVar[str] = (
        "Hopper HGEMM: a producer warpgroup streams A/B tiles with TMA (host-encoded tensor maps) or cp.async "
        "into a STAGES-deep ring of 128-byte-swizzled shared memory (mbarrier full/empty handshake); 1-4 consumer "
        "warpgroups issue wgmma.mma_async m64nNk16 from shared-memory descriptors (B MN-major via the transpose "
        "bit for kn), setmaxnreg moves registers to the consumers; grouped rasterisation; persistent blocks; "
        "direct, smem-staged or TMA-store (stmatrix) epilogue; split-K in thread-block clusters (fp32 partial "
        "tiles summed through distributed shared memory) and in K groups (partials through a global workspace, "
        "summed by the last CTA to arrive); clusters of 2 CTAs sharing each B tile by TMA multicast; swapped A and "
        "B roles for M <= 48 (C^T = B^T A^T, so a 16-row A is not padded to 64 wgmma rows)."
    )

    def derived(self, params: Params) -> dict[str, Any]:
        assert isinstance(params, Sm90WgmmaParams)
        return {"threads": params.threads, "smem_bytes": params.smem_bytes, "set_maxnreg": params.set_maxnreg,
                "producer_regs": params.producer_regs, "consumer_regs": params.consumer_regs,
                "wgmma_n": params.wgmma_n}

    def check_for_problem(self, params: Params, problem: Problem) -> None:
        assert isinstance(params, Sm90WgmmaParams)
        if problem.b_layout == "kn" and params.block_n % 64:
            raise ValueError(f"block_n={params.block_n}: with B in kn layout (MN-major for wgmma) block_n must be "
                             "a multiple of 64, the width of a 128-byte swizzle panel")

    def launch(self, params: dict[str, Any], problem: Problem) -> LaunchSpec:
        p = self.parse(params, problem)
        assert isinstance(p, Sm90WgmmaParams)
        tiles = -(-problem.m // p.block_m) * -(-problem.n // p.block_n)
        # split-K: the kernel's __cluster_dims__(split_k, 1, 1) groups consecutive blocks, one cluster per tile and K
        # group; k_groups > 1 adds the workspace (the groups' fp32 partial tiles) and one arrival counter per CTA of
        # a tile's cluster
        if p.cluster_m > 1:  # whole clusters: a trailing CTA past M still loads its share of B for its peers
            tiles = -(-problem.m // (p.block_m * p.cluster_m)) * p.cluster_m * -(-problem.n // p.block_n)
        grid = min(tiles, SMS * p.min_blocks) if p.persistent else tiles * p.split_k * p.k_groups
        grouped = p.k_groups > 1
        maps: tuple[TensorMapSpec, ...] = ()
        if p.loader == "tma":  # boxes land as 128-byte rows (64 fp16), swizzled like the cp.async copies
            k, n = problem.k, problem.n
            if problem.b_layout == "nk":
                b_map = TensorMapSpec("B", (k, n), (p.block_k, p.block_n // p.cluster_m))
            elif n % 64 == 0:  # 64-column panels as a third dimension 128 B apart: one copy per stage (and CTA)
                b_map = TensorMapSpec("B", (64, k, n // 64), (64, p.block_k, p.block_n // 64 // p.cluster_m),
                                      strides=(n * 2, 128))
            else:  # one copy per panel: a panel view would read past the last row's end
                b_map = TensorMapSpec("B", (n, k), (64, p.block_k))
            # where M fits one tile, the A box is only M rounded up to 8 rows (the kernel's a_box_rows)
            a_rows = min(p.block_m, -(-problem.m // 8) * 8)
            maps = (TensorMapSpec("A", (k, problem.m), (p.block_k, a_rows)), b_map)
        if p.epilogue == "tma":  # each consumer warpgroup stores its rows as 64-column panels
            maps += (TensorMapSpec("C", (problem.n, problem.m), (64, p.block_m // p.consumers)),)
        return LaunchSpec(grid=(grid, 1, 1), block=(p.threads, 1, 1), smem_bytes=p.smem_bytes, tensor_maps=maps,
                          workspace_bytes=p.k_groups * tiles * p.block_m * p.block_n * 4 if grouped else 0,
                          counters=tiles * p.split_k if grouped else 0)

    def space(self, problem: Problem) -> list[dict[str, Any]]:
        k_tiles = -(-problem.k // 64)
        shapes: list[tuple[float, list[Sm90WgmmaParams]]] = []
        for bm, bn, consumers in TILES:
            if problem.b_layout == "kn" and bn % 64:
                continue
            variants = []
            for stages in (4, 3, 5, 6, 8):  # preference order; the deepest ring that fits closes the list
                if stages > k_tiles + 1 and stages != 4:
                    continue  # a ring deeper than K only costs shared memory
                for min_blocks in (1, 2):
                    try:
                        variants.append(Sm90WgmmaParams(block_m=bm, block_n=bn, consumers=consumers,
                                                        stages=stages, min_blocks=min_blocks))
                    except ValueError:
                        continue
            if variants:
                ranked = sorted(variants, key=lambda v: _cost(v, problem))
                shapes.append((_cost(ranked[0], problem), ranked))
        shapes.sort(key=lambda item: item[0])
        picked: list[Sm90WgmmaParams] = []
        # The best shapes get more pipeline variants; the rest keep the search broad.
        for rank, (_, variants) in enumerate(shapes[:10]):
            picked.extend(variants[: 3 if rank < 3 else 2 if rank < 6 else 1])
        best = picked[0]
        tiles_m = -(-problem.m // best.block_m)
        for group in (16, 4, 1):
            if group < tiles_m or group == 1:
                picked.append(best.model_copy(update={"raster_group": group}))
        # Persistent blocks with TMA stores lead where the best guess gives a block more than one tile: the next
        # tile's loads and MMAs overlap the last one's stores (measured on the H200: 1.04-1.16x of cuBLAS at
        # K <= 128, where the others reach 0.8x; 1.0x at 4096 cubed), unless the room C takes beside the ring leaves
        # too shallow a ring for a long K. In one wave there is nothing to overlap (1024 cubed: 0.93x against 0.97x).
        one_wave = -(-problem.m // best.block_m) * -(-problem.n // best.block_n) <= SMS * best.min_blocks
        lead = [] if one_wave else list({
            v.model_dump_json(): v for v in (with_update(p, {"persistent": True, "epilogue": "tma"})
                                             for p in picked[:10])
            if v is not None and (v.stages >= 3 or v.stages > k_tiles)}.values())[:3]
        # Other epilogues of the two best guesses (persistent with direct stores measured 0.3-0.97x: left out).
        others = [with_update(p, u) for p in picked[:2] for u in ({"epilogue": "direct"}, {"epilogue": "tma"})]
        picked = lead + picked + [v for v in others if v is not None]
        # Long-K problems with few tiles: split-K settings first, K groups after the two best (measured on par with
        # them on 64_1024_16384); skinny problems with few tiles: K groups first. Every other list is unchanged.
        split = _split_settings(problem)
        ordered = _swap_settings(problem) + split[:2] + _group_settings(problem) + split[2:] + picked
        # The cp.async producer of the two best guesses, eighth: it wins now and then where TMA barely loses.
        ordered[8:8] = [v for v in (with_update(p, {"loader": "cp_async"}) for p in ordered[:2]) if v is not None]
        # Clusters of 2 sharing B by TMA multicast, twelfth: measured 0.9-1.0x of the same tiles without (1.07-1.17x
        # only where B's rows are off 128-byte boundaries), so for longer searches.
        wide = [p for p in picked if not p.persistent and p.block_n % 128 == 0][:2]
        ordered[12:12] = [v for v in (with_update(p, {"cluster_m": 2}) for p in wide) if v is not None]
        seen: dict[str, dict[str, Any]] = {}
        for p in ordered:
            seen.setdefault(p.model_dump_json(), p.model_dump())
        return list(seen.values())[:30]
