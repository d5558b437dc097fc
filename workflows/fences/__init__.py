"""Goal generation fences, turns and durable cancels (docs/lifecycles.md: fences, turn cancels)."""
