"""`trainstack doctor`: what trainstack runs on here, and on a cluster, against what it is
tested with.

    trainstack doctor
    trainstack doctor --address http://127.0.0.1:8265     # also a cluster's nodes

It prints each library's installed version beside trainstack's tested range, the
accelerators torch sees (CUDA, GPUs, NCCL, gloo), which private features of torch and
Ray this install can use (each has a fallback: `trainstack.compat`), and, given a
cluster's Job API, the Ray version the cluster runs and the libraries every node has,
asked by a small job that needs nothing but Ray. Exit 0 when everything is inside its
range, 1 when something is not (the last lines say what to install), 2 when the
cluster cannot be asked.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainstack.cli.probe import ClusterProbeError, NodeVersions, probe_cluster
from trainstack.stack import Found, found_from, install_command, versions_here


def add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check the installed libraries (and a cluster's) against trainstack's ranges",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="a Ray cluster's Job API, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS when "
        "it is one); its Ray and every node's libraries are checked too",
    )
    parser.set_defaults(handler=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    here = versions_here()
    lines = [_title("trainstack doctor"), *_about_this_python(), ""]
    lines += _library_table(here, heading="libraries here")
    lines += ["", *_accelerators(), "", *_compat_features()]
    print("\n".join(lines))
    wrong = [row for row in here if row.wrong]
    address = args.address or _job_api_address(os.environ.get("RAY_ADDRESS"))
    cluster_wrong: list[Found] = []
    if address is None:
        print("\nray cluster: not checked (give --address http://HEAD:8265 to check one)")
    else:
        try:
            nodes = probe_cluster(address)
        except ClusterProbeError as err:
            print(f"\nray cluster at {address}: {err}")
            print(f"trainstack: error: could not ask the cluster at {address}", file=sys.stderr)
            return 2
        for node in nodes:
            rows = found_from(node.versions)
            print("", *_library_table(rows, heading=f"node {node.describe()}"), sep="\n")
            cluster_wrong += [row for row in rows if row.wrong]
        print(_driver_and_cluster(here, nodes))
    print("")
    if not wrong and not cluster_wrong:
        print("verdict: every library is inside trainstack's tested ranges")
        return 0
    if wrong:
        print(f"verdict: outside trainstack's ranges here; fix with: {install_command(here)}")
    if cluster_wrong:
        print(
            "verdict: the cluster's nodes lack what trainstack needs: install it into its "
            "image, or have the job bring it (`trainstack submit --deps pip`, or `--deps uv`)"
        )
    return 1


def _title(text: str) -> str:
    return f"{text}\n{'-' * 72}"


def _about_this_python() -> list[str]:
    import trainstack

    location = Path(trainstack.__file__).resolve().parent
    version = _trainstack_version()
    return [
        f"{'trainstack':<26}{version} ({location})",
        f"{'python':<26}{sys.version.split()[0]} ({sys.executable})",
    ]


def _trainstack_version() -> str:
    from trainstack.stack import installed_version

    return installed_version("trainstack") or "not installed (imported from its source)"


def _library_table(rows: list[Found], *, heading: str) -> list[str]:
    out = [f"{heading:<26}{'installed':<16}{'tested':<18}status"]
    for row in rows:
        dep = row.dependency
        name = f"{dep.name} ({dep.needed_by})" if dep.needed_by else dep.name
        status = {
            "ok": "ok",
            "below": "TOO OLD: older than trainstack's floor",
            "above": "UNTESTED: newer than trainstack's top",
            "missing": "MISSING",
            "absent": f"not installed: needed for {dep.used_for}",
        }[row.status]
        out.append(f"{name:<26}{row.version or '-':<16}{dep.versions:<18}{status}")
    return out


def _accelerators() -> list[str]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as err:  # a broken torch is what doctor is for: say so
        return [f"{'accelerators':<26}torch does not import: {err}"]
    cuda = torch.cuda.is_available()
    built = torch.version.cuda
    if cuda:
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        gpus = f"{torch.cuda.device_count()} ({', '.join(names)})"
    else:
        gpus = "0"
    if cuda:
        cuda_line = f"yes (CUDA {built})"
    else:
        cuda_line = f"no (a CUDA {built} build, no GPU here)" if built else "no (a CPU build)"
    nccl = dist.is_available() and dist.is_nccl_available()
    nccl_line = "no"
    if nccl:
        version = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "built in"
        nccl_line = f"yes ({version})"
    gloo = dist.is_available() and dist.is_gloo_available()
    return [
        "accelerators",
        f"{'  cuda':<26}{cuda_line}",
        f"{'  gpus':<26}{gpus}",
        f"{'  nccl':<26}{nccl_line}",
        f"{'  gloo':<26}{'yes' if gloo else 'no'}",
    ]


def _compat_features() -> list[str]:
    """The compat modules' feature checks: what this torch and Ray offer beyond their
    public API, and what trainstack does where they do not."""
    out = ["private features (each feature-checked, with a fallback: trainstack.compat)"]
    for library, module in (
        ("torch", "trainstack.compat.torch"),
        ("ray", "trainstack.compat.ray"),
    ):
        try:
            features = __import__(module, fromlist=["features"]).features()
        except Exception as err:
            out.append(f"  {library}: not checked ({type(err).__name__}: {err})")
            continue
        for feature in features:
            state = "yes" if feature.available else f"no: {feature.fallback}"
            out.append(f"  {library + ': ' + feature.name:<40}{state}")
    return out


def _driver_and_cluster(here: list[Found], nodes: list[NodeVersions]) -> str:
    """Whether this Python could drive the cluster itself (`trainstack run --address`
    needs the cluster's Ray exactly; `trainstack submit` only its Job API)."""
    ours = next((row.version for row in here if row.dependency.name == "ray"), None)
    theirs = sorted({node.versions.get("ray") or "none" for node in nodes})
    if theirs == [ours]:
        return f"\nray {ours} here and on every node: `trainstack run --address` can drive it"
    return (
        f"\nray here {ours or 'not installed'}, on the cluster {', '.join(theirs)}: "
        "`trainstack run --address` needs the same Ray; `trainstack submit` does not"
    )


def _job_api_address(address: str | None) -> str | None:
    """`RAY_ADDRESS` when it names a Job API (http[s]://...), as `ray job submit` takes it."""
    if address and address.startswith(("http://", "https://")):
        return address
    return None
