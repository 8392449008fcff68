"""rlaudit.model"""
