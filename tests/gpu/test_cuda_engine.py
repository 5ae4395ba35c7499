"""The agents' per-record engine on a CUDA device (``pytest -m gpu``, on a GPU machine only).

Deselected by default (no CI machine has a GPU). Run on request where torch sees a CUDA device: each
test then fails, never skips, when it finds none. The same campaign job runs on the CPU and on the GPU
from the same seed; the releases every ledger charged, the run's shape and its accuracies must agree
up to float32 rounding of different kernels (TF32 is off on the engine's GPU path, client_agent/streaming.py).
``FEDFILTER_DATA_DIR``: the folder holding ``mnist/`` (default: the shared offline copy).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from client_agent.ledger import Ledger
from simulations.datasets.idx import default_data_dir
from simulations.reproductions.fz_sec51 import KIND_TRIAL, Job, Tuned, run_job

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

pytestmark = pytest.mark.gpu
DATA = Path(os.environ.get("FEDFILTER_DATA_DIR") or default_data_dir())


def _releases(out: Path) -> list[list[np.ndarray]]:
    """Per client, the l2 norms of every release its ledger charged, in order."""
    norms = []
    for pid in range(10):
        with Ledger.open_existing(out / "ledgers" / f"client{pid}.sqlite") as ledger:
            norms.append([np.asarray(rel["l2_norms"], dtype=np.float64) for _, _, rel in ledger.releases()])
    return norms


def test_a_campaign_job_on_cuda_charges_and_learns_as_on_the_cpu(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "pytest -m gpu: expected a CUDA device torch sees, found none"
    assert (DATA / "mnist").is_dir(), f"expected the MNIST IDX files under {DATA / 'mnist'}, found none"
    job = Job(KIND_TRIAL, 0.3, "suboptimal", "gd+renyi", 1, Tuned(steps=10, clip=1.0, learning_rate=2.0))
    common = {"data_dir": DATA, "train_limit": 300, "test_limit": 500}
    torch.cuda.reset_peak_memory_stats()
    cpu = run_job(job, out=tmp_path / "cpu", device="cpu", **common)
    gpu = run_job(job, out=tmp_path / "gpu", device="cuda", **common)
    assert torch.cuda.max_memory_allocated() > 0  # the engine ran there
    for c, g in zip(cpu, gpu, strict=True):
        assert (c["method"], c["rounds_completed"]) == (g["method"], g["rounds_completed"])
        assert c["active_per_round"] == g["active_per_round"]
        # 500 test records: 0.01 is 5 records; the two runs' models differ by float32 rounding only.
        for r, a in c["accuracy_by_round"].items():
            assert abs(a - g["accuracy_by_round"][r]) <= 0.01, (r, a, g["accuracy_by_round"][r])
    # Every ledger charged the same releases, norm for norm, up to float32 rounding of different kernels:
    # relative 1e-4, or 2e-4 of the clip (1.5 here, the scale of every charge) for a small norm. At lr 2 on
    # 300 records the logits reach the thousands, and a well-classified record's gradient is a difference
    # of probabilities near 1: on an H100 (2026-11-27) 29 of 30 norms of one release agreed to 1e-4
    # relative, and one of 0.0148 differed by 7.9e-5 (0.5 %), 5e-5 of the clip.
    clip = 1.5  # suboptimal epsilon 0.3: 1.5 C0
    for c_rel, g_rel in zip(_releases(tmp_path / "cpu"), _releases(tmp_path / "gpu"), strict=True):
        assert len(c_rel) == len(g_rel)
        for a, b in zip(c_rel, g_rel, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-4 * clip)


def test_one_gpu_block_gives_the_norms_and_sum_of_a_cpus_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client of 2,000 records of the MNIST CNN: two blocks of rows on the CPU (1,878 records a block), one on
    the GPU (7,514), the same norms and clipped sum up to float32 rounding of different kernels."""
    assert torch.cuda.is_available(), "pytest -m gpu: expected a CUDA device torch sees, found none"
    from client_agent import streaming, workloads
    from client_agent.streaming import ArraySource, fused_clipped_sum
    from workloads.builtin import BUILTIN
    from workloads.models import build_model

    model = build_model("opacus_mnist_cnn", seed=0)
    x = torch.randn(2_000, 1, 28, 28, generator=torch.Generator().manual_seed(6)).numpy()
    y = np.arange(2_000) % 10

    def weights(start: int, norms: np.ndarray) -> np.ndarray:
        return np.minimum(1.0, 0.5 / np.maximum(norms, 1e-12))

    real, blocks = streaming.block_records, []

    def counted(device: torch.device, row_floats: int) -> int:
        blocks.append((device.type, real(device, row_floats)))
        return blocks[-1][1]

    monkeypatch.setattr(streaming, "block_records", counted)
    runs = {}
    for device, chunk in (("cpu", workloads.CHUNK_RECORDS), ("cuda", workloads.DEVICE_CHUNK_RECORDS)):
        runs[device] = fused_clipped_sum(
            model, BUILTIN.loss, ArraySource(x, y), weights, chunk_size=chunk, device=device
        )
    assert blocks == [("cpu", 1_878), ("cpu", 1_878), ("cuda", 7_514)]
    (cpu_norms, cpu_sum, _), (gpu_norms, gpu_sum, _) = runs["cpu"], runs["cuda"]
    np.testing.assert_allclose(gpu_norms, cpu_norms, rtol=1e-4, atol=1e-6)
    assert np.linalg.norm(gpu_sum - cpu_sum) <= 1e-4 * np.linalg.norm(cpu_sum)
