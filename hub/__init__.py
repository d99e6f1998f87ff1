"""Hub: receives, validates, aligns, stores and records what the collectors send."""
