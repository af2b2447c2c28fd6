"""Helpers that several test modules share (not tests, not fixtures: those are in the conftest.py files)."""
