"""Fixtures of the RL tests: a tiny random chat checkpoint (`policy`) and its requests scripted to play
oracle.SCRIPT (`scripted`; tests/rl/oracle.py)."""

import pytest

from helpers import one_torch_thread, tiny_chat_checkpoint
from rl.oracle import SCRIPT, script_tokens


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one torch thread."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, tok = tiny_chat_checkpoint(tmp_path_factory.mktemp("rl") / "ck")
    model.eval()
    return model, tok


@pytest.fixture()
def scripted(policy, monkeypatch):
    """Every request's tokens follow SCRIPT."""
    return script_tokens(monkeypatch, policy[1], SCRIPT)


