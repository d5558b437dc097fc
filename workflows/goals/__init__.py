"""Goal control (docs/lifecycles.md: accept, goals): submit and the batched dispatcher."""
