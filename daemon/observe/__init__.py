"""What a node says about itself: the status model and its filling, /metrics, the `deltaswarm
status` CLI and its fleet view, and the live fleet page."""
