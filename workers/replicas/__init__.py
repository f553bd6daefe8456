"""Replicas: spawning, deleting, scaling and lending them, and their state machine."""
