"""`python -m multicard`: the same program as the installed `multicard` command (cli.main.entry)."""

from multicard.cli.main import entry

if __name__ == "__main__":
    entry()
