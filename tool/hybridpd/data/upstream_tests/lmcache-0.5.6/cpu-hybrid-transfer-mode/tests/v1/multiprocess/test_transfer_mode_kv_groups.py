# SPDX-License-Identifier: Apache-2.0
"""``create_transfer_context`` for a worker with several KV groups.

Engine-driven transfer registers one KV transfer group only, and ``auto``
resolves to it on CPU. A hybrid model (Mamba/linear-attention groups beside
attention groups) registers several, so ``auto`` must resolve to the
LMCache-driven path where the device serves it.
"""

# Standard
from unittest.mock import MagicMock

# Third Party
import pytest
import torch

# First Party
from lmcache.v1.multiprocess.transfer_context import (
    LMCacheDrivenTransferContext,
    MPTransferMode,
    create_transfer_context,
    resolve_transfer_mode,
    worker_transfer,
)
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
    ENV_MP_TRANSFER_MODE,
)

# Importing the CPU sub-package self-registers its KV-wrapper factory.
import lmcache.v1.platform.devices.cpu  # noqa: F401


@pytest.mark.parametrize(
    "mode", [None, "auto", MPTransferMode.AUTO], ids=["unset", "auto", "enum"]
)
def test_auto_mode_serves_several_kv_groups_on_cpu(
    mode: "str | MPTransferMode | None", monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` (also when unset) picks the LMCache-driven path for two
    KV groups on a CPU worker."""
    monkeypatch.delenv(ENV_MP_TRANSFER_MODE, raising=False)
    context = create_transfer_context(
        {"layer_0": torch.randn(2, 2), "layer_1": torch.randn(2, 2)},
        instance_id=1,
        req_client=MagicMock(),
        mode=mode,
        num_kv_groups=2,
    )
    assert isinstance(context, LMCacheDrivenTransferContext)


def test_auto_mode_from_env_serves_several_kv_groups_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LMCACHE_MP_TRANSFER_MODE=auto`` resolves the same way."""
    monkeypatch.setenv(ENV_MP_TRANSFER_MODE, "auto")
    context = create_transfer_context(
        {"layer_0": torch.randn(2, 2)},
        instance_id=1,
        req_client=MagicMock(),
        num_kv_groups=3,
    )
    assert isinstance(context, LMCacheDrivenTransferContext)


def test_auto_mode_keeps_other_devices_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device other than CPU whose default is engine-driven keeps it for
    several KV groups, although it may serve the LMCache-driven path (MUSA:
    handle mode is opt-in there)."""
    spec = MagicMock()
    spec.default_mp_transfer_mode.return_value = MPTransferMode.ENGINE_DRIVEN
    spec.is_lmcache_driven_available.return_value = True
    monkeypatch.setattr(worker_transfer, "get_device_spec", lambda device: spec)
    assert (
        resolve_transfer_mode("musa", MPTransferMode.AUTO, num_kv_groups=2)
        is MPTransferMode.ENGINE_DRIVEN
    )
    assert (
        resolve_transfer_mode("cpu", MPTransferMode.AUTO, num_kv_groups=2)
        is MPTransferMode.LMCACHE_DRIVEN
    )
