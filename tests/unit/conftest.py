"""The in-process tier: the gateway's own code over the fake driver, no runsc, no image."""

import pytest

from unit.inprocess import InProcessGateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """One in-process gateway per module, in place of tests/conftest.py's real one (max 4 kernels);
    that file's `kernel` fixture starts its kernel here."""
    gw = InProcessGateway(tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "4"})
    yield gw
    gw.stop()

