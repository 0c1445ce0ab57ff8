"""DeviceFacts: what the search, the sandbox and the prompts need to know of one GPU, read by its worker.

One record serves them all (SM count for wave counts, L2 size for cold timings, shared memory for the parameter
spaces, peak rates for the roofline and for timings too fast to be true). Where no GPU is at hand (compile-only
runs, CPU tests) the H200 we measure on stands in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Dense fp16 tensor-core flops per SM per clock (fp32 accumulation), by compute capability major version.
TENSOR_FLOPS_PER_CLOCK = {9: 4096, 8: 2048}


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
    name="NVIDIA H200", arch="sm_90a", cc="9.0", sms=132, l2_bytes=60 * 2**20, smem_per_block=227 * 1024,
    smem_per_sm=228 * 1024, memory_bytes=143771 * 2**20, tensor_tflops=132 * 1.98e9 * 4096 / 1e12, hbm_tbps=4.9,
)
