"""Reward functions: built-ins and the resolver for user functions (`module:function`, `file.py:function`)."""
