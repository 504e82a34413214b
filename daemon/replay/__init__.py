"""Offline trace replay through the real cache core (no model, no torch)."""
