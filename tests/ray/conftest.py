"""One local Ray instance for the whole `tests/ray/` session."""

import os
import socket
from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="session")
def state_api_of_no_other_instance() -> Iterator[None]:
    """For the Ray instances this session starts, a Ray state API that never answers.

    Ray Train's placement-group cleaner asks the state API whether its run's controller
    still lives. Told no address, the state API finds one on its own: the newest Ray
    instance on this machine, which may be another process's; that one does not know the
    controller, and the cleaner removes the live run's placement group (its workers die:
    "Destroying worker since its placement group was removed"). Pointed at a port this
    process holds and never listens on (Ray's processes inherit the environment), the
    question fails, as it would on a dashboard-less instance alone on the machine, and
    the cleaner keeps waiting (a run's placement group goes with its controller anyway).
    """
    with socket.socket() as unanswered:
        unanswered.bind(("127.0.0.1", 0))
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{unanswered.getsockname()[1]}"
        yield
        del os.environ["RAY_API_SERVER_ADDRESS"]


@pytest.fixture(scope="session")
def ray_cluster(state_api_of_no_other_instance: None) -> Iterator[None]:
    # "local": a new instance, never a cluster another test (or `ray start`) left behind.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
