"""Who the other daemons are: names, the one HTTP client, the peer book and head long-polls,
node identity, who holds what, and region-aware peering (which peers the swarm dials)."""
