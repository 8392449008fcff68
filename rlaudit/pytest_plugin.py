"""pytest plugin (registered through the ``pytest11`` entry point): scenarios as test items.

Kept import-light: heavy modules are imported only when scenarios are collected.
"""
