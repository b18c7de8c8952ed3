"""Stand-ins for the demo and the tests: a vLLM-like server that dies on cue, and a coding agent.

They let ralph-run's whole story (a server dying mid-loop, its death captured, a restart) run on any
machine, with no GPU, and look like the real thing in the logs.
"""
