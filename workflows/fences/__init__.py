"""Goal generation fences, turns and durable cancels (DESIGN 4.3, 4.5)."""
