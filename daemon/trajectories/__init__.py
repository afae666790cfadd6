"""Trajectories on their way back: the durable spool and the intake the routes use."""
