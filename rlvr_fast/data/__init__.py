"""Problem sets: the ``Problem`` record, loaders of MATH / GSM8K / plain JSON(L) files, the
study's prompt template and the embedded synthetic arithmetic task."""
