"""ddpdash's Streamlit dashboard: thin pages over plain modules (forms, charts, live data, history)."""
