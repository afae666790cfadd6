"""Versions through a node: the region's sync loop, the trainer's publish side, retention,
what live nodes hold, and the long-poll board they bump."""
