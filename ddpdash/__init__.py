"""ddpdash: a browser dashboard for PyTorch DDP runs. This top-level package is the public Python API
(what a user's script imports); the product lives in `ddpdash.trainer`, `ddpdash.db` and
`ddpdash.dashboard`. It stays light: importing it must not import torch, SQLAlchemy or Streamlit."""

__version__ = "0.2.0"
