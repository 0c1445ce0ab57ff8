// The gated fallback of an hgemm-agent export: act(gate) * up of an unfused gated GEMM's output y (rows x 2n
// elements, gate and up interleaved in blocks of 8 columns, row-major and contiguous) into out (rows x n), reading y
// once and writing out once, where PyTorch's two ops on strided views of the halves read y's sectors twice each.
// Each thread takes 8-column blocks: y's 16-byte gate block 2i and up block 2i + 1, out's block i (a grid-stride
// loop over the rows x n / 8 blocks). Rounded as a model's two ops round: the activation in fp32 (PyTorch's CUDA
// formula) rounded to the dtype, then the product of the two rounded values in fp32, rounded.
// Compiled by NVRTC once per dtype and activation with -DHGEMM_BF16=0|1 -DHGEMM_GELU=0|1, core/epilogue.py's to_f32
// for the dtype, hgemm_dtype.cuh's text (Block, rounded) and core/overlap.py's device code in front of it
// (agent/export/writer.py).

__device__ __forceinline__ float act(float x) {
#if HGEMM_GELU
    const float beta = 0.7978845608028654f;  // sqrt(2 / pi)
    const float kappa = 0.044715f;
    const float inner = beta * (x + kappa * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
#else
    return x / (1.0f + expf(-x));
#endif
}

extern "C" __global__ void __launch_bounds__(256)
hgemm(const Block* __restrict__ y, Block* __restrict__ out, long long blocks) {
    overlap_wait();  // launched overlapped: the kernel ahead (y's writer) has finished (core/overlap.py)
    overlap_release();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < blocks;
         i += (long long)gridDim.x * blockDim.x) {
        const Block g = y[2 * i], u = y[2 * i + 1];
        Block o;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            o.h[j] = rounded(to_f32(rounded(act(to_f32(g.h[j])))) * to_f32(u.h[j]));
        out[i] = o;
    }
}
