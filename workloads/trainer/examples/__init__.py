"""Bundled example training tasks."""
