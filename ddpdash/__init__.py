"""ddpdash: a browser dashboard for PyTorch DDP runs. This top-level package is the public Python API
for a user's own script (`ddpdash.log`, `ddpdash.should_stop`, …: see ddpdash/api.py); the product
lives in `ddpdash.trainer`, `ddpdash.db` and `ddpdash.dashboard`. It stays light: importing it imports
neither torch, SQLAlchemy nor Streamlit."""

from .api import RunSettings, event, finish, init, log, should_stop

__all__ = ["RunSettings", "event", "finish", "init", "log", "should_stop"]
__version__ = "0.2.0"
