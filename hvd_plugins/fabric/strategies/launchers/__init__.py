"""Fabric launchers."""
