"""The autoscaler: the demand gateways report, the decision, and the pass on beat."""
