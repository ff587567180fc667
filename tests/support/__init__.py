"""What the unit and integration suites share: the tests' own models (named by import path)."""
