"""The wire schema (pydantic v2), with OpenAI's own model names.

Request models validate ranges and build engine `SamplingParams`; response models
are what the serving classes return. Nothing here knows about HTTP.

One module per endpoint family (`chat`, `completion`, `tgi`, `tokenize`, `models`) over
the shared pieces in `base`, `sampling` and `structured`; callers import from those
modules directly, so this package re-exports nothing (a second list of every name would
only drift).
"""
