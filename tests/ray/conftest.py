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
    still lives. Ray's own, told no address, lets the state API find one on its own: "the"
    Ray instance on this machine, which may be another process's (that one does not know
    the controller, and the cleaner ends or removes the live run's placement group).
    trainstack's trainer gives its cleaner its own instance's address
    (`compat.ray.own_instance_cleaner_class`); this setting, which wins over that
    address, keeps any cleaner of a run here from asking anyone, as on a dashboard-less
    instance alone on the machine: it keeps waiting (these runs end normally, and a run
    that ends normally removes its group itself).
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
