"""Rank-zero output and the checks between the two Lightning packages."""
