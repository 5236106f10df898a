"""LoRA adapters in the engine core: PEFT files in (`adapter.py`), resident slots and
the per-step batch (`manager.py`), the hook inside every `Linear` (`layer.py`). The
worker-side half (names, fetching from S3) is `engine/lora_source.py`, torch-free."""
