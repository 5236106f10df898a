"""The building blocks a model file composes (docs/architecture.md, "Backends").

Each layer owns its parameters and says *what* it computes; *which kernel* computes it
is decided once at start-up: a linear layer's `LinearMethod` (engine/layers/linear.py,
engine/layers/gguf_linear.py), the attention backend (engine/attention/), and the kernel
backend of the elementwise ops (kernels/registry.py).
"""
