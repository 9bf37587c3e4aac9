"""k3: the Kimi K3 system in PyTorch."""
