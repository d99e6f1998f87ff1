"""Reduced-scope rerun planning and launching."""
