"""The Textual TUI."""
