"""benchmarks/multi_gpu.py's bookkeeping (the GPU part runs on a multi-GPU machine: see benchmarks/RESULTS.md)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import multi_gpu as mg  # noqa: E402


def test_cpulist_parsing():
    assert mg.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert mg.parse_cpulist("") == set()


def test_unknown_numa_node_is_minus_one():
    assert mg.numa_node(None) == -1
    assert mg.numa_node("ffff:ff:ff.7") == -1
    assert mg.node_cpus(-1) == set()


def row(op, gpus, rank, gbps=None, us=100.0, node=0, overlap=1.0):
    return dict(op=op, gpus=gpus, rank=rank, gbps=gbps, us_per_iter=us, numa_node=node, overlap=overlap)


def test_summary_compares_each_gpu_with_itself_alone():
    rows = [row("bulk", 1, 0, 50.0), row("bulk", 1, 1, 40.0, node=1),  # GPU 1 is slower even alone
            row("bulk", 2, 0, 45.0), row("bulk", 2, 1, 40.0, node=1),
            row("gather", 1, 0, 40.0), row("gather", 1, 1, 40.0, node=1),
            row("gather", 2, 0, 30.0, overlap=0.97), row("gather", 2, 1, 20.0, node=1, overlap=0.97),
            row("decode", 1, 0, us=700.0), row("decode", 1, 1, us=700.0, node=1),
            row("decode", 2, 0, us=720.0), row("decode", 2, 1, us=770.0, node=1)]
    s = {(x["op"], x["gpus"]): x for x in mg.summarise(rows, [1, 2])}
    assert s["bulk", 1]["aggregate_vs_bulk"] == pytest.approx(1.0) and s["bulk", 1]["per_gpu_gbps"] == [50.0]
    assert s["bulk", 2]["aggregate_gbps"] == pytest.approx(85.0)
    assert s["bulk", 2]["aggregate_vs_bulk"] == pytest.approx(85.0 / 100.0)
    assert s["bulk", 2]["worst_vs_alone"] == pytest.approx(45.0 / 50.0)  # GPU 1 kept all of its own 40
    assert s["gather", 2]["worst_vs_alone"] == pytest.approx(20.0 / 40.0)
    assert s["gather", 2]["numa_nodes"] == [0, 1] and s["gather", 2]["overlap"] == pytest.approx(0.97)
    assert s["decode", 2]["worst_vs_alone"] == pytest.approx(700.0 / 770.0)
    mg.print_table(list(s.values()))


def test_summary_without_a_baseline_says_so_instead_of_failing():
    rows = [row("gather", 2, 0, 30.0), row("gather", 2, 1, 20.0)]
    (line,) = mg.summarise(rows, [2])
    assert line["worst_vs_alone"] is None and line["aggregate_vs_bulk"] is None
    mg.print_table([line])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_without_cuda_it_says_so(capsys):
    assert mg.main(["--out", "/tmp/unused"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
