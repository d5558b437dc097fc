"""Operating the fleet (DESIGN 4.10): finding and listing every kind of operation."""
