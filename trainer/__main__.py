"""Run one rank of a ddpdash training run (what torchrun starts):

    torchrun --nproc-per-node 2 -m ddpdash.trainer --config RUN_DIR/config.json [--run-id N] [--db-url URL]

or, as one plain process without torchrun:

    python -m ddpdash.trainer --config RUN_DIR/config.json
"""

from .train import main

if __name__ == "__main__":
    raise SystemExit(main())
