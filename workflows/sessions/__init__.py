"""Sessions (DESIGN 4.4, 4.9): the session row and its event log, the hosts sessions live on,
and a session's history."""
