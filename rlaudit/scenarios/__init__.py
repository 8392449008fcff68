"""rlaudit.scenarios"""
