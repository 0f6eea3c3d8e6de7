"""SideStream's bookkeeping: the main stream waits for the side stream only where work was queued there since its
last wait. Inside a CUDA graph capture, waiting for a stream that took no captured work is an error
(cudaErrorStreamCaptureIsolation): a real SGLang server failed its decode-graph capture so, with ESS layers that
neither prefetch nor refill (docs/sglang.md, "Serving on the GPU test machine")."""

from unittest import mock

import torch

from ess_sglang.streams import SideStream


def _streams_that_record_waits():
    s = SideStream(torch.device("cpu"))
    s.cuda = True  # the bookkeeping of the CUDA path, with the stream calls recorded instead of made
    s.side = s.normal = object()
    main = mock.MagicMock()
    return s, main


def test_the_main_stream_waits_only_for_queued_side_work():
    s, main = _streams_that_record_waits()
    with mock.patch("torch.cuda.current_stream", return_value=main), mock.patch("torch.cuda.stream"):
        s.wait()  # nothing queued: no wait (a capture would fail here)
        assert main.wait_stream.call_count == 0
        s.side = mock.MagicMock()
        with s.on_side():
            pass
        s.wait()
        assert main.wait_stream.call_count == 1
        s.wait()  # joined already: no second wait
        assert main.wait_stream.call_count == 1
        s.normal = mock.MagicMock()
        with s.on_normal():
            pass
        s.wait()
        assert main.wait_stream.call_count == 2


def test_on_cpu_the_flag_follows_the_same_rules():
    s = SideStream(torch.device("cpu"))
    assert not s.queued
    with s.on_side():
        pass
    assert s.queued
    s.wait()
    assert not s.queued
