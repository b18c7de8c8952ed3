"""`python -m bench`: run every case and print the table."""

from bench.run import main

if __name__ == "__main__":
    raise SystemExit(main())
