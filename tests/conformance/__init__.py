"""Conformance suite: SEMANTICS.md on every available backend."""
