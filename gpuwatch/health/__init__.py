"""Health judgement: pure functions of timestamped samples and events (never hardware, files or the clock)."""
