"""Prompt datasets: files, saved `datasets` folders, built-in tasks; tokenisation and length policy."""
