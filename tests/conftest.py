"""Test-suite options: `--runslow` also runs tests marked slow (the README's full-suite command);
`--sweep` also runs the whole OpInfo sweep (tests marked sweep; as long as bench/opinfo.py).

The README's command runs the suite in pytest-xdist workers (`-n auto --dist worksteal`): each test
must pass in any worker, after any other test, next to a test of another worker."""

import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption("--sweep", action="store_true", default=False, help="also run the whole OpInfo sweep")


def pytest_configure(config):
    # xdist workers share the cores: torch's intra-op threads of N workers would oversubscribe them.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    skips = {
        "slow": None if config.getoption("--runslow") else pytest.mark.skip(reason="slow: run with --runslow"),
        "sweep": None if config.getoption("--sweep") else pytest.mark.skip(reason="OpInfo sweep: run with --sweep"),
    }
    for item in items:
        for keyword, skip in skips.items():
            if skip is not None and keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def fresh_compile_state(tmp_path, monkeypatch):
    """Dynamo, the compile report and graph-break counters start empty; compiled graphs go to a fresh cache."""
    from torch._dynamo.utils import counters

    from neuron_inductor.observe import session

    monkeypatch.setenv("NEURON_INDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    session.clear()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def fresh_module_cache(tmp_path_factory):
    """Compile into an empty cache folder for the whole module: every check runs the current code,
    not an earlier entry."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEURON_INDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("module_cache")))
        yield
