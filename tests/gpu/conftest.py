"""tests/gpu: what only a CUDA GPU can show. `make test-gpu` (= pytest -rs tests/gpu) runs it on a GPU machine; on
any other machine every test here is skipped, with the reason, at no cost (nothing starts, nothing is built)."""
import pytest


def cuda_devices():
    """How many CUDA GPUs torch sees (0 on a CPU-only build or machine)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    here = [item for item in items if "tests/gpu/" in item.nodeid.replace("\\", "/")]
    if not here:
        return
    count = cuda_devices()
    for item in here:
        needs = item.get_closest_marker("gpus")
        wanted = needs.args[0] if needs else 1
        if count < wanted:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {wanted} CUDA GPU(s), this machine has {count}: run `make test-gpu` on a GPU machine"))
