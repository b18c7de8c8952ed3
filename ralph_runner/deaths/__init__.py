"""Deaths as data: the log and its JSONL twin, the flight recorder, signatures, the iteration
history, statistics."""
