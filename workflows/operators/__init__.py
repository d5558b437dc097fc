"""Operating the fleet (docs/operations.md): finding and listing every kind of operation."""
