"""Test-suite options: `--runslow` also runs tests marked slow (the README's full-suite command);
`--sweep` also runs the whole OpInfo sweep (tests marked sweep; as long as bench/opinfo.py)."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption("--sweep", action="store_true", default=False, help="also run the whole OpInfo sweep")


def pytest_collection_modifyitems(config, items):
    skips = {
        "slow": None if config.getoption("--runslow") else pytest.mark.skip(reason="slow: run with --runslow"),
        "sweep": None if config.getoption("--sweep") else pytest.mark.skip(reason="OpInfo sweep: run with --sweep"),
    }
    for item in items:
        for keyword, skip in skips.items():
            if skip is not None and keyword in item.keywords:
                item.add_marker(skip)
