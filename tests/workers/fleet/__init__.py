"""GPU inventory, GPU allocation, placement policies and CPU hogs."""
