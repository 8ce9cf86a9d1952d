"""What runs on the user's machine to read a run back, never in a worker: the measured timeline
against the cost models' predictions (report, host_load, refit), its charts (gantt, chrome_trace),
the single-process reference a run must equal, and a training state moved onto new cuts (restage)."""
