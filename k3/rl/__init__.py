"""Reinforcement learning (report §4.1.2, §5.3.1): agent rollouts with partial rollouts on the serving engine
(k3.rl.rollout), Kimi K2.5's per-token objective and a clipped baseline (k3.rl.loss), reasoning-effort budgets and
the `k3 rl` run (k3.rl.trainer, k3.rl.cli)."""
