"""`trainstack report RUN`: PNG plots and a `report.md` for one tracked run.

    trainstack report runs/demo            # a run directory: its tracking.json names the run
    trainstack report 7497a136d4fc4376b3e23e66a4a57030 --tracking-uri sqlite:///mlflow.db

`runs.py` reads the run from MLflow, `plots.py` draws, `document.py` writes report.md;
the command is `trainstack.cli.report`.
"""
