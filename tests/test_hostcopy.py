"""`PinnedStaging`: host -> device copies through a ring of reused pinned buffers."""

from __future__ import annotations

import pytest
import torch

from tts_server.hostcopy import PinnedStaging


def _cases(n: int):
    g = torch.Generator().manual_seed(0)
    for i in range(n):  # sizes that grow past the first buffers, dtypes, a transposed view, empty
        size = int(torch.randint(0, 40_000 if i % 7 == 3 else 300, (1,), generator=g))
        kind = i % 4
        if kind == 0:
            yield torch.randint(-2**40, 2**40, (size,), generator=g)
        elif kind == 1:
            yield torch.randn(3, size, generator=g).T  # not contiguous
        elif kind == 2:
            yield torch.randint(0, 2**31 - 1, (size, 2), generator=g, dtype=torch.int32)
        else:
            yield torch.randn(size, generator=g).to(torch.bfloat16)


def test_cpu_is_a_plain_copy():
    st = PinnedStaging(slots=2)
    for t in _cases(10):
        out = st.to_device(t, "cpu")
        assert out.dtype == t.dtype and torch.equal(out, t)


@pytest.mark.gpu
def test_cuda_copies_stay_right_across_the_ring():
    """More copies than buffers, queued behind long kernels so that they are still pending when
    the ring comes round: every result equals its source (a buffer refilled before its copy ran
    would show)."""
    st = PinnedStaging(slots=3, min_bytes=64)
    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    outs, srcs = [], []
    for t in _cases(40):
        busy = busy @ busy / 64  # keeps the stream busy while the copies queue
        outs.append(st.to_device(t, dev))
        srcs.append(t.clone())
    torch.cuda.synchronize()
    for o, s in zip(outs, srcs):
        assert o.device.type == "cuda" and o.dtype == s.dtype and torch.equal(o.cpu(), s)
