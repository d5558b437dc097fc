"""Goal control (DESIGN 4.1, 4.2): submit and the batched dispatcher."""
