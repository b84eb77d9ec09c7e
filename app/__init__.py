"""The web dashboard over run records (`bapo dashboard RUN_DIR...`); installed as bapo_vl.app.

data.py reads the SQLite record (read-only, cached until it changes), views.py turns what it read into tables
and Vega-Lite charts, dashboard.py lays out the Gradio page and wires it, cli.py parses the command line.
Gradio is imported only by dashboard.py, so the rest of bapo-vl does not need it.
"""
