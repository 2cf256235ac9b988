"""The stage worker's engine: forward, backward, inner steps, the redo of a lost hop."""
