"""Built-in models: the tiny random-init checkpoints the default run and the tests build locally. Imports
config only."""
