"""The workdir the agent works in: its checklist, its git facts, and the names of ralph-run's
own files in it (`.ralph/`)."""
