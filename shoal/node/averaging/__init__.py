"""Replicas of a stage that share weights every H steps: NoLoCo's pairs and the DiLoCo baseline."""
