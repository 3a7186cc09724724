"""ddpdash: a browser dashboard for PyTorch DDP runs. This top-level package is the public Python API
for a user's own script (`ddpdash.log`, `ddpdash.should_stop`, …: see ddpdash/api.py) and the
`ddpdash.Recipe` a user's own model and data are handed over in (ddpdash/recipe.py); the product
lives in `ddpdash.trainer`, `ddpdash.db` and `ddpdash.dashboard`. It stays light: importing it imports
neither torch, SQLAlchemy nor Streamlit."""

from .api import RunSettings, event, finish, init, log, phase, should_stop, watch
from .recipe import Recipe

__all__ = ["Recipe", "RunSettings", "event", "finish", "init", "log", "phase", "should_stop", "watch"]
__version__ = "0.2.0"
