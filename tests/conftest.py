import pytest

import adaptive_eager as ae


@pytest.fixture(autouse=True)
def _fresh_metrics():
    """Every test starts with zeroed counters and leaves adaptive eager off for this thread."""
    ae.reset_metrics()
    yield
    ae.disable()
