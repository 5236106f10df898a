"""The layer rules of docs/architecture.md ("Layers and imports") hold: the
import-linter contracts of pyproject.toml, run here so `make test` (and so CI) checks
them as `make lint` does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint_imports is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_installed_distribution_shadows_or_is_shadowed_by_our_kernels_package() -> None:
    """Hugging Face's `kernels` distribution has the same top-level import name as our
    kernels/ package; transformers 5.25 requires it, and with both present
    `import transformers.activations` imports ours and fails far from the cause
    (`cannot import name 'CUDAProperties' from 'kernels'`, CI on stop 29). pyproject.toml
    caps transformers below 5.25 for this; this test names the clash if anything pulls
    the distribution in again."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions().get("kernels", [])
    foreign = sorted({name for name in owners if name.lower() != "hearth"})
    assert not foreign, (
        f"{foreign} install a top-level `kernels` module that clashes with hearth's kernels/ "
        "package; pin the dependency that requires it (see pyproject.toml's transformers cap)"
    )
    import transformers.activations  # noqa: F401  (the import that the clash breaks)
