"""Generation on torch: the ``hf`` in-process engine, its decoders, and the ``in_process`` weight sync."""
