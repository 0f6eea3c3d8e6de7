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


def replay_us(graph) -> float:
    """Microseconds of one replay of a captured CUDA graph, between CUDA events (waits for it to finish)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3
