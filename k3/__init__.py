"""k3: the Kimi K3 system in PyTorch (architecture, training, serving)."""

from k3.config import ConfigError, K3Config, PRESETS

__version__ = "0.1.0"

__all__ = ["K3Config", "ConfigError", "PRESETS", "K3ForCausalLM", "from_pretrained", "save_pretrained",
           "CheckpointError"]


def __getattr__(name):
    # The model and checkpoint modules import torch; load them on first use so `k3 --help` stays fast.
    if name == "K3ForCausalLM":
        from k3.model.model import K3ForCausalLM

        return K3ForCausalLM
    if name in ("from_pretrained", "save_pretrained", "CheckpointError"):
        import k3.checkpoint as ck

        return getattr(ck, name)
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
