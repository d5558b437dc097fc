"""Tools, apart from the rules: the CLI, the demo, the benchmark, the embedded stack, the
runtime simulator, status."""
