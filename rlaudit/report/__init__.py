"""rlaudit.report"""
