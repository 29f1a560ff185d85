"""Elastic training without Lightning: where an epoch stands across resizes, and snapshots in host memory."""
