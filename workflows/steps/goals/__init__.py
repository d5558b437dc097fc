"""Goal dispatch (DESIGN 4.2, 4.8; docs/dispatch.md): lanes and claims, the named claim of a
lone message, and the calls in flight with each host's bulkhead."""
