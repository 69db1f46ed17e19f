"""Registers the fixtures of native_support.py for the native-binding tests."""

from .native_support import recorders

__all__ = ["recorders"]
