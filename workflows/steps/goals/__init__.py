"""Goal dispatch (docs/lifecycles.md: goals, leases; docs/dispatch.md): lanes and claims, the named
claim of a lone message, and the calls in flight with each host's bulkhead."""
