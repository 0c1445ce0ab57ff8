"""The sandbox: NVRTC builds, and the GPU worker that checks and times untrusted kernels in its own process."""
