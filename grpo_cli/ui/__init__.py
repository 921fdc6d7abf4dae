"""Terminal output; the only package that imports rich. The bottom layer: imports config only."""
