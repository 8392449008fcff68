"""rlaudit.rollout"""
