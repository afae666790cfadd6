"""The fleet view: what a daemon knows of other nodes from their signed reports, and how those
reports travel."""
