"""Planners on the rollout engine: they decide which sequences to add, fork and stop, and
produce no tokens themselves (``rlvr_fast.engine`` does). Flat groups and batches
(``generation``), two-stage trees (``trees``, with the pair record of ``pairs``), parallel paths
(``parallel``), evaluation (``evaluation``), pass-rate selection of training data (``selection``)
and the size limits a rollout is checked against (``limits``)."""
