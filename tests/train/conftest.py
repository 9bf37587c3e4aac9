import pytest
import torch


@pytest.fixture
def one_thread():
    # Tiny matrices gain nothing from intra-op threads, and on a busy machine a thread pool can stall.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
