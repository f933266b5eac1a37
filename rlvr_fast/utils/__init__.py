"""Helpers every layer may use: atomic files (``files``)."""
