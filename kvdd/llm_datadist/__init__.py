"""CANN's ``llm_datadist`` Python package on kvdd's simulator (docs/spec/PYPKG.md)."""
