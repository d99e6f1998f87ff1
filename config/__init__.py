"""Reference configuration shipped with rankscope: default settings, topology examples,
launcher templates and simulated scenarios (TOML files, no code)."""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
"""Folder holding ``default.toml``, ``scenarios/``, ``launchers/`` and ``topology/``."""
