"Shared pytest configuration: the `gpu` marker (skipped unless CUDA and SGLang are available)."
import importlib.util, sys
from pathlib import Path
import pytest

# the repository root, so `pytest` finds the package without an install
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _gpu_ready() -> bool:
    try:
        import torch
        return torch.cuda.is_available() and importlib.util.find_spec('sglang') is not None
    except Exception:
        return False


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs a CUDA device and SGLang; skipped otherwise')
    config.addinivalue_line('markers', 'slow: slow test')


def pytest_collection_modifyitems(config, items):
    if _gpu_ready(): return
    skip = pytest.mark.skip(reason='needs a CUDA device and SGLang')
    for item in items:
        if 'gpu' in item.keywords: item.add_marker(skip)
