"""The supervisor's part in a benchmark: a process of its own, in a session of its own, at the
supervisor's priority (trainer.supervisor.priority.yield_cpu_to_training), serving one run's metrics relay —
what `trainer.supervisor` does for a launched run, without starting torchrun (the benchmark does).

    python bench/relay_host.py --db-url URL --run-id N

Prints the ranks' environment (one JSON line), then serves until its standard input closes, drains
the relay (every rank's metrics written) and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddpdash.db.engine import make_engine
from ddpdash.trainer.relay import Listener
from ddpdash.trainer.supervisor.priority import supervisor_nice, yield_cpu_to_training
from ddpdash.trainer.supervisor.relay_server import RelayServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db-url", required=True)
    p.add_argument("--run-id", type=int, required=True)
    args = p.parse_args()
    yield_cpu_to_training(supervisor_nice())
    listener = Listener()
    server = RelayServer(make_engine(args.db_url), args.run_id, listener)
    print(json.dumps(listener.env()), flush=True)
    sys.stdin.read()  # until the benchmark closes it: the ranks have exited
    server.drain()


if __name__ == "__main__":
    main()
