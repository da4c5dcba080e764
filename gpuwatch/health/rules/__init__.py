"""One module per concern, each with stable `RULE_IDS` and three pure functions.

`conditions(static, cfg)` names the per-sample tests it judges over a window, `judge(evidence, cfg)`
turns evidence.Evidence into findings, and `evaluate(history, cfg)` is the windowed reference: judge()
over a rescan of a History.
"""
