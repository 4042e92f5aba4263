"""Training on torch: the ``local_torch`` train service, its data-parallel ranks and sharded checkpoints."""
