"""The HTTP API, /metrics and the status page: the server, its JSON bodies, and the client."""
