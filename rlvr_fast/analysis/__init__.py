"""Reading run directories back: ``verify`` re-derives a run's ledger and grades, ``compare``
builds the study's tables over arms x seeds, ``report`` draws its figures, ``sweep`` runs a grid
of arms x seeds and then compares and reports. ``run_dir`` is the one place that reads the files a
run writes."""
