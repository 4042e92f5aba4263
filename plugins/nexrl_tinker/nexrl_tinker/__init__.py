"""nexrl-tinker: training and sampling through the Tinker API (the ``tinker`` SDK)."""
