"""ddpdash's trainer: what torchrun runs in each rank (config, data, models, the loop, the metrics logger), and the
process control that starts and stops it (commands, control, the run folder, the supervisor)."""
