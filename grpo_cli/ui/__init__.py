"""Terminal output; the only package that imports rich."""
