"""Files in and out: feature tables and Parquet, row ranges of an input, atomic writes,
folder locks, run folders published in one step, and what a command prints."""
