"""The deltaswarm node: swarm, control plane, sync loop, trajectory spool, status, systemd glue."""
