"""Model smoke tests run torch single-threaded: their tensors are small, and on a 2-core machine shared
with other work, intra-op threads mostly wait for each other (10x slower element-wise ops measured)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
