"""What a session's host reports and what follows (docs/lifecycles.md): activity reports,
runtime epochs, session stops, and a user's own session control."""
