"""The main stream and one side stream: where the decode stack and the SGLang plugin queue work that overlaps
compute (prefetches, copies, refills of spare slots), and how the main stream waits for it."""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """The main stream and one side stream on CUDA; on CPU, no-ops (steps then run in program order)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # High priority: the block scheduler then runs the side stream's few blocks (resolve, copies) as soon as SMs
        # free up, instead of after every queued block of the main stream's big kernels (the indexer).
        self.side = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        # The main stream's priority: for side work whose wide kernels must not take every SM ahead of the main
        # stream's (`on_normal`)
        self.normal = torch.cuda.Stream(device, priority=0) if self.cuda else None
        self.queued = False
        """Work was queued on the side stream since the main stream last waited for all of it. Waiting when nothing
        was queued is skipped: inside a CUDA graph capture, a wait for a stream that took no captured work is an
        error (cudaErrorStreamCaptureIsolation), as a decode layer that neither prefetches nor refills has none."""

    def on_side(self, after=None):
        """Work in this block runs on the side stream, after everything queued there before and everything queued
        on the main stream so far; given `after` (an event recorded on another stream), after that event instead of
        the main stream: the caller makes sure that the event follows every write the block reads."""
        self.queued = True
        if not self.cuda:
            return contextlib.nullcontext()
        if after is None:
            self.side.wait_stream(torch.cuda.current_stream())
        else:
            self.side.wait_event(after)
        return torch.cuda.stream(self.side)

    @contextlib.contextmanager
    def on_normal(self):
        """Side work at the main stream's priority: work in this block runs on a second stream, after everything
        queued on the side stream and on the main stream so far, and the side stream waits for it when the block ends:
        ordered as `on_side()` orders it (whatever is queued on the side stream later, and every wait for the side
        stream, follows it), at another priority. For work beside latency-bound main-stream kernels: a high-priority
        launch of many blocks takes every free SM before the main stream's next kernel gets one."""
        self.queued = True
        if not self.cuda:
            yield
            return
        self.normal.wait_stream(torch.cuda.current_stream())
        self.normal.wait_stream(self.side)
        try:
            with torch.cuda.stream(self.normal):
                yield
        finally:  # (also when the block raises: whatever it queued is joined, a graph capture is left joinable)
            self.side.wait_stream(self.normal)

    def mark(self):
        """An event on the side stream: what has been queued there so far."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev

    def wait(self, ev=None) -> None:
        """The main stream waits for a mark (or for everything queued on the side stream)."""
        if ev is None:
            if self.queued and self.cuda:
                torch.cuda.current_stream().wait_stream(self.side)
            self.queued = False
        elif self.cuda:
            torch.cuda.current_stream().wait_event(ev)
