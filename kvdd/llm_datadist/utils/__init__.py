"""Argument checks and logging of the ``llm_datadist`` package (PYPKG.md §1.1, §2.1)."""
