"""`deltaswarm demo`: the whole system (a trainer with its daemon, regions with daemons and
workers) on one machine. It sits above daemon/, trainer/ and rollout/ and may import all three."""
