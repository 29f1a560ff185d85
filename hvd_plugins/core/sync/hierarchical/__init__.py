"""``sync="hierarchical"``: the two-level legs per bucket, and the tuner that times them against flat."""
