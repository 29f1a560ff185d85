"""Elastic training without Lightning: where an epoch stands across resizes (``cursor``, ``epoch_split``), snapshots
in host memory, the attempts of a training function, and what a reset does to the gradient sync (``reset``)."""
