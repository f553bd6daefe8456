"""Fleet: nodes, their health, and where replicas are placed on them and their GPUs."""
