"""Poisoned-rollout attacks (Hail to the Thief, grpo_attacks.md), for experiments only.

Nothing here runs unless a node is started with `--experiment-adversary NAME`, a benchmark or a test
asks for it: honest nodes never import this package. Attacks are pure functions from a round's
prompts (and the attacker's own policy) to the bundle the attacker shares; each also says whether an
honest completion carries its payload, which is how attack success is measured.
"""

from shoal.adversary.attacks import ATTACKS, Attack, Forgery, get_attack

__all__ = ["ATTACKS", "Attack", "Forgery", "get_attack"]
