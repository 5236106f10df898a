"""Structured outputs in the engine: compile a request's constraint into a grammar, mask
each step's logits to the tokens the grammar allows, advance it with the sampled token.

The torch/xgrammar side lives here so that API workers (which import `engine` but never
torch) do not pay for it: `engine.sampling_params.StructuredOutputSpec` is the only part
they see.
"""
