"""DeviceFacts: what the search, the sandbox and the prompts need to know of one GPU, read by its worker.

One record serves them all (SM count for wave counts, L2 size for cold timings, shared memory for the parameter
spaces, peak rates for the roofline and for timings too fast to be true). Where no GPU is at hand (compile-only
runs, CPU tests) the H200 we measure on stands in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# Dense fp16 tensor-core flops per SM per clock (fp32 accumulation), by compute capability major version.
TENSOR_FLOPS_PER_CLOCK = {9: 4096, 8: 2048}


@dataclass(frozen=True)
class ArchLimits:
    """What every GPU of an arch gives a kernel built for it: a family's parameter model checks settings against its
    arch's limits before anything compiles; `DeviceFacts.limits` says the same of one device."""

    smem_per_block: int  # opt-in maximum of dynamic shared memory per block
    smem_per_sm: int
    smem_reserved_per_block: int  # the driver's own share of each resident block's shared memory
    regs_per_sm: int
    threads_per_sm: int

    def resident_threads(self, registers: int, threads: int, smem: int = 0) -> int:
        """Threads of whole blocks of `threads` an SM holds at once by registers (`registers` a thread, allocated in
        eights), shared memory (`smem` a block) and threads."""
        by_regs = self.regs_per_sm // (-(-max(registers, 1) // 8) * 8 * threads)
        by_smem = self.smem_per_sm // (smem + self.smem_reserved_per_block)
        return min(by_regs, by_smem, self.threads_per_sm // threads) * threads


ARCH_LIMITS = {"sm_90a": ArchLimits(227 * 1024, 228 * 1024, 1024, 65536, 2048),
               "sm_80": ArchLimits(163 * 1024, 164 * 1024, 1024, 65536, 2048)}
# Thread-block clusters of 2, 4 and 8 CTAs that ran at once per CTA slot of an SM on the H200: a cluster must fit
# inside one GPC, so fewer than 132 / size (docs/decisions.md `clusters-per-slot`)
H200_CLUSTERS_AT_ONCE = {2: 66, 4: 30, 8: 14}


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    arch: str  # the NVRTC target its kernels are built for: sm_90a or sm_80
    cc: str  # compute capability, "9.0"
    sms: int
    l2_bytes: int
    smem_per_block: int  # opt-in maximum of dynamic shared memory per block
    smem_per_sm: int
    memory_bytes: int
    tensor_tflops: float  # dense fp16 tensor-core rate at the highest SM clock: no honest kernel runs faster
    hbm_tbps: float  # memory bandwidth from the memory clock and bus width
    software: dict[str, Any] = field(default_factory=dict)  # driver, torch, CUDA, clocks: recorded, never decided on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def limits(self) -> ArchLimits:
        """This device's limits: its own shared memory, the rest as its arch gives every device."""
        return replace(ARCH_LIMITS[self.arch], smem_per_block=self.smem_per_block, smem_per_sm=self.smem_per_sm)

    @property
    def overlaps(self) -> bool:
        """Whether a kernel may be launched overlapped with the one ahead of it (programmatic dependent launch,
        sm_90 and newer; core/overlap.py)."""
        return self.arch.startswith("sm_9")

    def clusters_at_once(self, size: int) -> int:
        """Thread-block clusters of `size` CTAs that run at once per CTA slot of an SM (size 1: one CTA an SM; 0 for
        a size no cluster takes): as many as ran on the H200, and never more than sms // size."""
        return self.sms if size <= 1 else min(H200_CLUSTERS_AT_ONCE.get(size, 0), self.sms // size)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DeviceFacts:
        """Facts from a stored record; keys it lacks (older runs) come from the H200 stand-in."""
        if not data:
            return H200
        known = {f.name for f in fields(cls)}
        values = {**H200.to_dict(), **{k: v for k, v in data.items() if k in known}}
        values["software"] = {**values.get("software", {}), **{k: v for k, v in data.items() if k not in known}}
        return cls(**values)


H200 = DeviceFacts(
    name="NVIDIA H200", arch="sm_90a", cc="9.0", sms=132, l2_bytes=60 * 2**20,
    smem_per_block=ARCH_LIMITS["sm_90a"].smem_per_block, smem_per_sm=ARCH_LIMITS["sm_90a"].smem_per_sm,
    memory_bytes=143771 * 2**20, tensor_tflops=132 * 1.98e9 * 4096 / 1e12, hbm_tbps=4.9,
)
