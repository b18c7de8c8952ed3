"""Where and how commands run: one process path, tree kills, the guard that outlives a kill -9."""
