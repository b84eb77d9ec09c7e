"""The web dashboard over run records (`bapo dashboard RUN_DIR...`); installed as bapo_vl.app.

bapo_vl.reader reads the SQLite record (read-only, cached until it changes; `bapo runs show` uses it too),
data.py adds what only the dashboard reads (the runs named, the prompt drill-down), views.py turns what they read
into tables and Vega-Lite charts, dashboard.py lays out the Gradio page and wires it, cli.py parses the command
line.
Gradio is imported only by dashboard.py, so the rest of bapo-vl does not need it.
"""
