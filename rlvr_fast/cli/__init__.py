"""The ``rlvr-fast`` command line: parse, validate, hand over."""
