"""`trainstack` command line: one module per command, `app.py` lists them.

trainstack run jobs/configs/demo.yaml --set train.steps=50 --summary-json out.json
trainstack prepare jobs/configs/stdlib_gpt.yaml
trainstack sweep tune/demo_sweep.yaml [--resume]
trainstack plan jobs/configs/demo.yaml --devices 8 --device-memory 80GB
trainstack submit jobs/configs/demo.yaml --address http://127.0.0.1:8265 --deps image
trainstack doctor [--address http://127.0.0.1:8265]
trainstack report runs/demo
"""

from trainstack.cli.app import main

__all__ = ["main"]
