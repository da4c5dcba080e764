"""One node's sampling, judging and state: the monitor (live or on a trace), the store, the runtime dir."""
