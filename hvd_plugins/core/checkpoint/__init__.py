"""Checkpoints in torch's distributed checkpoint format (DCP): the boxes a sharded tensor is saved as, reading a
DCP directory whole, and writing one with every worker writing its own shards."""
