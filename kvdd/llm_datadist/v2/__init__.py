"""The cache-manager ("v2") layer of CANN's ``llm_datadist`` package (PYPKG.md §3-§5)."""
