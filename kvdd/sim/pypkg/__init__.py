"""The simulator's engine for CANN's ``llm_datadist`` Python package (docs/spec/PYPKG.md).

Implements :class:`kvdd.llm_datadist._seam.Wrapper` over kvdd's simulator.
"""
