"""ddpdash's trainer: what torchrun runs, plus the launcher and CLI that start it."""
