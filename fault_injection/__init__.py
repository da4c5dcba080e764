"""Fault injectors, each runnable as its own process: `python3 fault_injection/<name>.py ...`."""
