"""Speculative decoding (report §5.4.2): drafts (draft.py), the acceptance rule that keeps the output the target's
(accept.py); the engine verifies the drafts in one batched forward (ModelRunner.verify) and rolls KDA back by
replaying the accepted positions (ModelRunner.replay, k3.ops.kda_replay)."""
