// The RMSNorm of an hgemm-agent export: Llama's RMSNorm (transformers' LlamaRMSNorm, Mistral's, Qwen2's) of x
// (rows x h elements, row-major, contiguous, h a multiple of 8) with weight w (h elements, x's dtype) into out, in
// one kernel where the model runs eight (to fp32, square, mean, + eps, rsqrt, scale, to the dtype, times w); `kind`
// 1: Gemma's (GemmaRMSNorm, Qwen3-Next's: the weight stored as w - 1, nine ops); 2: Olmo 2's and GPT-OSS's (the
// weight times the fp32 value, then to the dtype).
// One block a row: each thread sums the squares of its 8-element blocks in fp32, the block adds the sums up, and
// the row's scale r = rsqrt(sum * (1 / h) + eps) is applied as the model rounds: Llama's x * r in fp32 rounded to
// the dtype, then w times that rounded value in fp32, rounded; Gemma's x * r times (1 + w) in fp32, rounded once;
// kind 2's x * r times w in fp32, rounded once.
// With a residual (rows x h, x's dtype; or null) the rounded norm is added to it and rounded again, as a layer that
// adds its norm's output to the residual does (Gemma 2's and Olmo 2's norms after the attention and the MLP).
// Compiled by NVRTC once per dtype with -DHGEMM_BF16=0|1, core/epilogue.py's to_f32 for the dtype, hgemm_dtype.cuh's
// text (Block, rounded) and core/overlap.py's device code in front of it (agent/export/writer.py).

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
hgemm(const Block* __restrict__ x, const Block* __restrict__ w, const Block* __restrict__ residual,
      Block* __restrict__ out, int h, float eps, int kind) {
    __shared__ float partial[THREADS / 32];
    overlap_wait();  // launched overlapped: the kernel ahead (x's writer) has finished (core/overlap.py)
    overlap_release();
    const int blocks = h / 8;
    const Block* row = x + (long long)blockIdx.x * blocks;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < blocks; i += THREADS) {
        const Block v = row[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float f = to_f32(v.h[j]);
            sum += f * f;
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x % 32 == 0)
        partial[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = 0.0f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i)
        sum += partial[i];
    const float r = rsqrtf(sum * (1.0f / (float)h) + eps);
    Block* dst = out + (long long)blockIdx.x * blocks;
    for (int i = threadIdx.x; i < blocks; i += THREADS) {
        const Block v = row[i], g = w[i];
        Block o;
        if (kind == 1) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                o.h[j] = rounded((to_f32(v.h[j]) * r) * (1.0f + to_f32(g.h[j])));
        } else if (kind == 2) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                o.h[j] = rounded(to_f32(g.h[j]) * (to_f32(v.h[j]) * r));
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                o.h[j] = rounded(to_f32(g.h[j]) * to_f32(rounded(to_f32(v.h[j]) * r)));
        }
        if (residual) {
            const Block s = residual[(long long)blockIdx.x * blocks + i];
#pragma unroll
            for (int j = 0; j < 8; ++j)
                o.h[j] = rounded(to_f32(s.h[j]) + to_f32(o.h[j]));
        }
        dst[i] = o;
    }
}
