"""Fixtures shared by the engine tests (model_* names belong to the model-loading tests)."""

from __future__ import annotations

import os

import pytest

# Nothing in the engine tests may reach a model hub; set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
