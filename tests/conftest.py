import pytest

import _device
import adaptive_eager as ae

_device.install()  # before any test module is imported: Note [Test device] in _device.py


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Compiled regions go to a cache of this test session, never the user's ~/.cache."""
    with ae.defaults(cache_dir=str(tmp_path_factory.mktemp("adaptive_eager_cache"))):
        yield


@pytest.fixture(autouse=True)
def _fresh_metrics():
    """Every test starts with zeroed counters and leaves adaptive eager off for this thread."""
    ae.reset_metrics()
    yield
    ae.disable()


@pytest.fixture
def fresh_regions():
    """No in-memory region, shape class or scalar group of an earlier test answers for this one
    (tests that count compiles or replays need a cold process's view)."""
    import fuser

    fuser.cache_clear()
    yield
