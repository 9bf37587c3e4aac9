"""Distributed tests fork gloo processes on a 2-core machine: every test of this folder runs its torch ops on one
thread (the forked ranks inherit it), so the ranks do not fight over the cores."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
