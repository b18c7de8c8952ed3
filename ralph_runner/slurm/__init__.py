"""Loops as Slurm jobs: a jobs file, one batch script per loop, sbatch and friends, the records."""
