"""The Ralph loop itself: iterations, strikes, the state and its lock, failures, limits, pause."""
