"""hgemm-agent: searches fast half-precision matrix-multiply CUDA kernels and proves them against cuBLAS.

`agent.record_gemm_shapes(path)` records a model's GEMMs into a shapes file (see agent.recorder); it is imported
on first use, so `python -m agent` starts without importing torch.
"""


def __getattr__(name: str):
    if name == "record_gemm_shapes":
        from agent.recorder import record_gemm_shapes

        return record_gemm_shapes
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
