"""The command line: argument parsing and launching (main.py), the worker side of train/eval/export
(commands.py)."""
