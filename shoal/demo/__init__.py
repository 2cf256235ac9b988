"""`shoal demo`: a whole swarm on one machine, as real processes on loopback."""
