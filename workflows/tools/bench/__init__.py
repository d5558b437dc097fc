"""`agent-radar bench` (DESIGN 8): a standard Celery baseline beside goal operations end to
end, on the configured database and broker, every figure a ratio within one run."""
