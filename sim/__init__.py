"""Simulated training cluster that emits through the real collector and wire format."""
