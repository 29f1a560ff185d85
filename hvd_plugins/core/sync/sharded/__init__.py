"""``shard="optimizer"`` (ZeRO-1) and ``shard="gradients"`` (ZeRO-2): each worker keeps and steps its slices."""
