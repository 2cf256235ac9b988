"""Getting a stage's weights: copy them from a live replica, or rebuild them from the neighbours (CheckFree)."""
