"""The device the device-generic tests run on: cpu, or ``AE_TEST_DEVICE=neuron`` for the emulated
``neuron`` device (adaptive_eager.neuron_emulation). This module holds no tests.

Note [Test device]
~~~~~~~~~~~~~~~~~~
With ``AE_TEST_DEVICE=neuron`` conftest installs the emulated device before any test module is
imported and makes it torch's default device (``torch.set_default_device``), so a contract test's
``torch.randn(4)`` is a ``neuron`` tensor and its eager oracle runs op by op there, without a
device argument in each test. adaptive eager then defaults to that device, and the compiled
variant of a test uses ``COMPILED_BACKEND``, the backend that compiles for it (``stablehlo``, which
stands in for neuronx-cc). Renaming PrivateUse1 is for the whole process, so a test run is on one
device: tests/test_neuron_emulation.py runs such a run in a child process.
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("AE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "neuron"):
    raise ValueError(f"AE_TEST_DEVICE={DEVICE!r}: expected cpu or neuron")
NEURON = DEVICE == "neuron"
COMPILED_BACKEND = "stablehlo" if NEURON else "inductor"


def install() -> None:
    """Make ``DEVICE`` this process's default device (Note [Test device])."""
    if NEURON:
        import torch

        import adaptive_eager as ae

        ae.emulate_neuron()
        torch.set_default_device(DEVICE)
