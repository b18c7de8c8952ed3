"""One module per command, each with `main(args) -> exit code`."""
