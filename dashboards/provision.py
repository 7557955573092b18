"""Put trainstack's Grafana dashboard where the running Ray session's Grafana provisioning
loads it, so the Grafana that `ray start` configures shows trainstack's panels beside
Ray's own (`make grafana` runs this).

    ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \\
        --metrics-export-port=8080
    python dashboards/provision.py            # the newest session, /tmp/ray/session_latest
    ray metrics launch-prometheus
    grafana server --config /tmp/ray/session_latest/metrics/grafana/grafana.ini \\
        --homepath /usr/share/grafana web

Ray writes a dashboards provider for each session
(`metrics/grafana/provisioning/dashboards/default.yml`); the dashboard goes into the
folder that provider names. A Ray that wrote no Grafana config (started without
metrics) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

DASHBOARD = Path(__file__).resolve().parent / "grafana_trainstack.json"
PROVIDER = Path("metrics/grafana/provisioning/dashboards/default.yml")


def dashboards_folder(session: Path) -> Path:
    """The folder the session's Grafana dashboards provider reads."""
    provider = session / PROVIDER
    if not provider.is_file():
        raise FileNotFoundError(f"{provider}: no Grafana provisioning in this Ray session")
    config = yaml.safe_load(provider.read_text())
    return Path(config["providers"][0]["options"]["path"])


def provision(session: Path) -> Path:
    """Copy the dashboard into the session's provisioned folder; return the copy."""
    json.loads(DASHBOARD.read_text())  # a damaged dashboard is refused, not copied
    folder = dashboards_folder(session)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / DASHBOARD.name
    shutil.copyfile(DASHBOARD, target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--session-dir",
        type=Path,
        default=Path("/tmp/ray/session_latest"),
        help="the Ray session (default: the newest on this machine)",
    )
    args = parser.parse_args()
    try:
        target = provision(args.session_dir.resolve())
    except (FileNotFoundError, KeyError, IndexError, TypeError) as err:
        print(f"provision: error: {err}; start Ray first (ray start --head)", file=sys.stderr)
        return 2
    print(f"provision: {target} (Grafana loads it at its next start, folder Ray)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
