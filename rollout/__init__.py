"""Rollout side: inference engines, verifiable tasks, and the worker that generates, scores and
posts trajectories to its local daemon. Imports nothing from trainer/ or daemon/."""
