"""Collaborative GRPO on verifiable tasks (DESIGN §6): the pure core a rollout worker calls.

tasks (prompts and rewards) · tokenizer · policy (spec and decoder) · warmup (cached supervised start)
· sampling · rollout (bundles <-> batches) · round (one node's round) · evaluate (held-out accuracy).
The losses live in `shoal.grpo.loss`, the wire type and its validator in `shoal.protocol.rollout`.
"""
