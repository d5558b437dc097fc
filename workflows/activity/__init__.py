"""What a session's host reports and what follows (DESIGN 4.3, 4.4, 4.9): activity reports,
runtime epochs, session stops, and a user's own session control."""
