// What the export's helper kernels (hgemm_gated.cu, hgemm_norm.cu) share: 16-byte blocks of 8 elements, and fp32 to
// an element of the dtype (fp16, or bf16 with -DHGEMM_BF16=1), rounded to nearest even. The writer
// (agent/export/writer.py) compiles each kernel with this text in front of it, after core/epilogue.py's to_f32 for the
// dtype; no other headers needed.

struct __align__(16) Block {
    unsigned short h[8];
};

__device__ __forceinline__ unsigned short rounded(float f) {
    unsigned short h;
#if HGEMM_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}
