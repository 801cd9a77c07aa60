"""Small helpers every stage may use: tensor walking, batched norms, host statistics, names, redaction,
sanitising, rank helpers, schedules, the one device-to-host copy. Nothing here imports another stage.
"""
