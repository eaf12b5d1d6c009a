"""Prompt data for the toolkit: sources, chat templates, dedup + leakage-checked selection, filters."""
