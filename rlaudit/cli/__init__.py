"""rlaudit.cli"""
