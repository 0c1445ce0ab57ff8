"""hgemm-agent: searches fast half-precision matrix-multiply CUDA kernels and proves them against cuBLAS."""
