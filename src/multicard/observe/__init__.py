"""What a run shows and records: the console and progress bar, metrics and trackers, the stall watchdog,
run records."""
