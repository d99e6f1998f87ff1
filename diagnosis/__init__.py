"""Diagnosis core: pure numpy analysis over a `Window` of the store."""
