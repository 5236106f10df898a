"""Native model implementations run by the engine on the paged KV cache.

Import `engine.models.registry` (or a model module) explicitly: this package itself
imports nothing so that importing `engine.models` never pulls in torch or the kernels.
"""
