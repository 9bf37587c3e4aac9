"""Speculative decoding (report §5.4.2): drafts (draft.py), the acceptance rule that keeps the output the target's
(accept.py), speculation on or off per decode batch size by measurement (switch.py), and the object that runs them in
a serving step (decoder.py, `SpeculativeDecoder`: propose, verify through ModelRunner.execute, accept, commit by
replaying the accepted positions into the KDA states, KimiDeltaAttention.replay / k3.ops.kda_replay)."""
