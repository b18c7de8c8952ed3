"""ralph-run: keeps long autonomous coding-agent loops alive on GPU hosts."""
