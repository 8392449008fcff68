"""rlaudit.backends"""
