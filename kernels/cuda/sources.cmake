set(LCE_CUDA_SOURCES)  # filled in by the CUDA backend
