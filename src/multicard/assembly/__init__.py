"""How a run is assembled: its plan, decided before any part is built and frozen (plan.py), the
checks made before it starts (preflight.py), and the one object that builds its parts from the plan
(parts.py: the process, stop, sinks, checkpointer, watchdog; process.py: how the process is made).

multicard.Run (the public API) and `multicard eval` take their parts from here; the tools and the
command line do not (tests/test_structure.py), but for the launcher's checks (preflight.py)."""
