"""The run supervisor: the process that starts torchrun for one run, relays its ranks' metrics into
the store, and records the truth at the end. Everything in this package runs in the supervisor's
process (entry point: `python -m ddpdash.trainer.supervisor`, started by trainer.control.launch)."""
