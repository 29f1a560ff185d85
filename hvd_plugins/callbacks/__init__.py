"""Callbacks that show what a distributed run is doing (rank 0 prints, every rank measures)."""
