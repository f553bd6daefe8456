"""Claims, cold starts, leases and the reaper."""
