"""Timing shared by the GPU benchmarks: CUDA events around each call, median over rotating inputs."""

import statistics
import sys
import time

import torch

SLEEP_CYCLES = 200_000  # ~100 us of GPU busy-wait: longer than the host takes to launch a kernel or a graph


def events_around(fn, *args) -> tuple:
    """Run fn(*args) between two CUDA events, after a GPU busy-wait: the host queues the event, the work and the
    second event while the GPU waits, so the time between the events is the work's own, without the host's launch
    latency (which a decode step's graph pays once, not per layer). Returns the events; does not synchronise."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    a.record()
    fn(*args)
    b.record()
    return a, b


def median_us(fn, inputs, reps=20, warmup=3):
    """Median microseconds of fn(*inputs[i % len(inputs)]) over `reps` calls (`events_around` each), after `warmup`
    untimed ones."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = events_around(fn, *inputs[i % len(inputs)])
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def replay_us(graph) -> float:
    """Microseconds of one replay of a captured CUDA graph (`events_around`; waits for it to finish)."""
    a, b = events_around(graph.replay)
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def run_info(**extra) -> dict:
    """The header of a benchmark's JSON: device, torch version, date and the command line, plus `extra`."""
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command="python " + " ".join(sys.argv), **extra)
