"""hgemm-agent: searches fast half-precision matrix-multiply CUDA kernels and proves them against cuBLAS.

`agent.main(argv)` runs the command line (`python -m agent`, `hgemm-agent`); `agent.record_gemm_shapes(path)` records
a model's GEMMs into a shapes file (see agent.recorder). Both are imported on first use, so importing the package (and
starting `python -m agent`) imports neither torch nor the command line's dependencies.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "main", "record_gemm_shapes"]


def __getattr__(name: str):
    if name == "record_gemm_shapes":
        from agent.recorder import record_gemm_shapes

        return record_gemm_shapes
    if name == "main":
        from agent.cli import main

        return main
    raise AttributeError(f"module 'agent' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
