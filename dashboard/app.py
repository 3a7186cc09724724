"""ddpdash dashboard's Streamlit script (`ddpdash ui` serves it behind the web gate, dashboard/server.py):

    streamlit run dashboard/server.py
"""

import streamlit as st

from ddpdash.dashboard import nav

st.set_page_config(page_title="ddpdash", page_icon=":material/monitoring:", layout="wide")
st.navigation(nav.pages()).run()
