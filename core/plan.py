"""LaunchPlan: how one setting of a kernel family launches on one device (its C tiles, blocks, clusters, waves and
shared memory), computed once from the setting and the device's facts, so that the launch rule, the cost models and
the search's rules count them the same way; and `ceil_div`, the one rounding-up division they all use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from core.device import DeviceFacts


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for positive b."""
    return -(-a // b)


@dataclass(frozen=True)
class LaunchPlan:
    """A setting's launch on a device. The family says what its setting launches (tiles, CTAs a tile, cluster size,
    blocks per SM, persistent or not, shared memory and threads a block); the rest follows from the device."""

    tiles: int  # C tiles the launch covers, in whole clusters of tiles where CTAs share operands
    tile_ctas: int  # CTAs a C tile (its K split over them; 1: whole in K)
    cluster: int  # CTAs a thread-block cluster (1: no cluster)
    min_blocks: int  # blocks per SM the launch bounds ask for
    persistent: bool  # blocks stride over the tiles, as many as the SMs hold at once
    smem_bytes: int
    threads: int
    device: DeviceFacts

    @cached_property
    def persistent_slots(self) -> int:
        """Blocks a persistent launch runs: the SMs' blocks, in whole clusters."""
        return self.device.sms * self.min_blocks // self.cluster * self.cluster

    @cached_property
    def ctas(self) -> int:
        """Blocks launched (the grid)."""
        return min(self.tiles, self.persistent_slots) if self.persistent else self.tiles * self.tile_ctas

    @cached_property
    def clusters(self) -> int:
        """Thread-block clusters launched (each CTA its own where there are none)."""
        return self.ctas // self.cluster

    @cached_property
    def waves(self) -> int:
        """Waves of C tiles over the SMs at the blocks per SM the launch bounds ask for."""
        return ceil_div(self.tiles, self.device.sms * self.min_blocks)

    @cached_property
    def blocks_per_busy_sm(self) -> int:
        """Tiles an SM holds at once where the tiles are fewer than its blocks fill."""
        return min(self.min_blocks, ceil_div(self.tiles, self.device.sms))

    @cached_property
    def resident(self) -> int:
        """Blocks an SM holds at once by shared memory and threads."""
        limits = self.device.limits
        return min(limits.smem_per_sm // (self.smem_bytes + limits.smem_reserved_per_block),
                   limits.threads_per_sm // self.threads)

    @cached_property
    def clusters_at_once(self) -> int:
        """Clusters of this size that run at once per CTA slot of an SM (no cluster: one CTA an SM)."""
        return self.device.clusters_at_once(self.cluster)
