"""Triton kernels (GPU path; run on CPU only under TRITON_INTERPRET=1), one module per op."""
