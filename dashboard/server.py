"""The dashboard's ASGI app: Streamlit (dashboard/app.py) behind the web gate (dashboard/gate.py).

    streamlit run dashboard/server.py --server.port 8501 ...     (what `ddpdash ui` runs)
"""

from pathlib import Path

import streamlit as st
from starlette.middleware import Middleware

from ddpdash.dashboard.gate import WebGate

app = st.App(str(Path(__file__).resolve().parent / "app.py"), middleware=[Middleware(WebGate)])
