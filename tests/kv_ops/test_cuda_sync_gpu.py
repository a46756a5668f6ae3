"""The raw CUDA calls against torch's own on a real device (skipped where none is visible, as in CI)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru.kv_ops import cuda_sync  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_current_raw_stream_is_torchs_current_stream_in_and_out_of_a_stream_context() -> None:
    """``current_raw_stream`` replaces ``torch.cuda.current_stream()`` on the forward thread: it must
    follow a stream context (vLLM may run its forward on a side stream) and the device set."""
    assert cuda_sync.current_raw_stream() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert cuda_sync.current_raw_stream() == side.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert cuda_sync.current_raw_stream() == torch.cuda.current_stream().cuda_stream
    last = torch.cuda.device_count() - 1
    other = torch.cuda.Stream(device=last)
    with torch.cuda.device(last), torch.cuda.stream(other):
        assert cuda_sync.current_raw_stream() == other.cuda_stream
