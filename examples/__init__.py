"""Worked examples (not part of the rlaudit package). Run from the repository root."""
