"""Timing shared by the GPU benchmarks: CUDA events around each call, median over rotating inputs."""

import statistics

import torch

SLEEP_CYCLES = 200_000  # ~100 us of GPU busy-wait: longer than the host takes to launch a kernel or a graph


def median_us(fn, inputs, reps=20, warmup=3):
    """Median microseconds of fn(*inputs[i % len(inputs)]) over `reps` calls, after `warmup` untimed ones (each
    after a GPU busy-wait, as in `replay_us`: the device time of the work, without the host's launch latency)."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        torch.cuda._sleep(SLEEP_CYCLES)  # the host launches fn while the GPU waits: its launch latency is not timed
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def replay_us(graph) -> float:
    """Microseconds of one replay of a captured CUDA graph, between CUDA events (waits for it to finish).

    A GPU busy-wait runs first, so that the host has queued the event, the replay and the second event before the
    GPU gets there: the time is the graph's own, without the host's launch latency (which a decode step's graph
    pays once, not per layer). The HiSparse harness (hisparse_kernel.GraphRunner) times the same way."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3
