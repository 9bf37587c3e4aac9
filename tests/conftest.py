import pytest

from k3.config import K3Config


@pytest.fixture
def tiny_cfg() -> K3Config:
    # fp32, with MTP off unless a test asks for it.
    return K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
