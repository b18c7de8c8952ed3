"""The Ralph loop itself: iterations, the checklist, strikes, the state files, git."""
