"""rlaudit.update"""
