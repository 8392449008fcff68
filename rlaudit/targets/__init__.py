"""rlaudit.targets"""
