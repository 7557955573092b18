"""What a run shows of itself: throughput and MFU (`throughput.py`), live series on Ray's
Prometheus endpoint (`prometheus.py`) and its MLflow run (`tracking.py`)."""
