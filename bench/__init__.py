"""Benchmarks: ralph-run against the approaches it replaces, on the same stand-in server.

`python -m bench` (from the repository root) measures ralph-run, the seed's bash loop
(bench/seed/, rebuilt from the blog post) and Ansible (bench/ansible/) case by case, the peers
alternating, and prints a markdown table of medians and ratios. Importing the package runs nothing.
"""
