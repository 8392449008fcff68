"""rlaudit.trainer"""
