"""The bottom layer, which every other may use: the configuration, errors and exit codes, atomic files,
the version, the host's memory and allocator, torch version shims."""
