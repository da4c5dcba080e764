"""One module per concern, each a pure `evaluate(history, cfg) -> list[Finding]` with stable `RULE_IDS`."""
