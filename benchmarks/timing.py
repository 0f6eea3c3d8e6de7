"""Timing shared by the GPU benchmarks: CUDA events around each call, median over rotating inputs."""

import statistics

import torch


def median_us(fn, inputs, reps=20, warmup=3):
    """Median microseconds of fn(*inputs[i % len(inputs)]) over `reps` calls, after `warmup` untimed ones."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


SLEEP_CYCLES = 200_000  # ~100 us of GPU busy-wait: longer than the host takes to launch a graph


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
