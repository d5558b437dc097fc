"""Sessions (DESIGN 4.4, 4.7): the session row and its event log, activity reports, session
control, prompts and history."""
