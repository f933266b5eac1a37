"""What a run directory holds, on disk, atomically: the directory and its signature
(``directory``), the state file of checkpoints (``state_file``), and the reader the analysis
commands use (``reader``)."""
