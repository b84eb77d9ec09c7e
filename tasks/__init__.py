"""Bundled task plugins: one folder per task, each with a task.py (see bapo_vl.plugins)."""
