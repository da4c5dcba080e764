"""Fault injectors, each runnable as its own process from a checkout: `python3 fault_injection/<name>.py ...`.

Each is a few lines over the package, where the injectors live and ship: `gpuwatch drill` (gpuwatch/drills/)
and the sacrificial XID process gpuwatch/drills/xid_fault.py.
"""
