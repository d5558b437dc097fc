"""`agent-radar bench` (docs/benchmarks.md): a standard Celery baseline beside goal operations end
to end, on the configured database and broker, every figure a ratio within one run."""
