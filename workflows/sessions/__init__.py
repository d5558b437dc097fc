"""Sessions (docs/lifecycles.md: turns, sessions): the session row and its event log, the hosts
sessions live on, and a session's history."""
