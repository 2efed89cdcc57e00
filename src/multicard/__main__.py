import gc

from multicard.cli import main

if __name__ == "__main__":
    code = main()
    # Interpreter shutdown would walk every object torch's modules made (~0.7 s per process on
    # our CPUs); frozen, they are left to the OS. Exit handlers and thread joins still run.
    gc.freeze()
    raise SystemExit(code)
