"""Processes: the launcher (torchrun's API, Slurm, cloud environments), each process's context (process
group, device, threads), graceful stop and exit handling, the user's code, the run folder's lock."""
