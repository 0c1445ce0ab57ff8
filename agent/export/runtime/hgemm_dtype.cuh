// What the export's helper kernels (hgemm_gated.cu, hgemm_norm.cu) share: 16-byte blocks of 8 elements, and an
// element of the dtype (fp16, or bf16 with -DHGEMM_BF16=1) to fp32 and back, rounded to nearest even. The writer
// (agent/export/writer.py) compiles each kernel with this text in front of it; no other headers needed.

struct __align__(16) Block {
    unsigned short h[8];
};

__device__ __forceinline__ float to_f32(unsigned short h) {
#if HGEMM_BF16
    return __uint_as_float((unsigned int)h << 16);  // a bf16 is the upper half of the fp32 of the same value
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ unsigned short rounded(float f) {
    unsigned short h;
#if HGEMM_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}
