"""ddpdash dashboard entry point:

    streamlit run dashboard/app.py      (or: ddpdash ui)
"""

import streamlit as st

from ddpdash.dashboard import auth, nav

st.set_page_config(page_title="ddpdash", page_icon=":material/monitoring:", layout="wide")
if auth.gate():
    st.navigation(nav.pages()).run()
