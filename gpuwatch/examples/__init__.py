"""Applications of the library: what a job imports, shown whole."""
