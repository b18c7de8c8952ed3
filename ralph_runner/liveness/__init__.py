"""Is the service alive? Probes in rounds, the watch during a step, diagnostics, recovery."""
