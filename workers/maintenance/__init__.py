"""Maintenance passes on beat: reaping, reconciling, auditing and re-driving."""
