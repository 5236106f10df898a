"""What the engine process does once it is ready, before it serves (engine/process.py)."""

from __future__ import annotations

import gc

from engine.core import freeze_startup_objects


def test_freezing_start_up_objects_takes_them_out_of_the_cyclic_collector() -> None:
    """After start-up every live object goes to the permanent generation, so the
    collections each step triggers no longer traverse the model (2 % of a decode step)."""
    start_up = [[] for _ in range(10)]  # tracked containers, as the model's objects are
    gc.collect()
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(start_up)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
