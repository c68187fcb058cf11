"""jaxflow's tests. `HANG_S` bounds a wait on a process or thread: a bound for hangs only, far beyond the slowest
machine's run, never a check of speed."""
HANG_S = 3600
