"""In-rank collector: records step and collective timings and streams them to the hub."""
