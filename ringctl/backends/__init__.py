"""Where jobs run: `local` (processes on this machine), `slurm` (sbatch here), `ssh` (sbatch on a
remote login node). Each backend is one module behind the small interface in `base`."""
