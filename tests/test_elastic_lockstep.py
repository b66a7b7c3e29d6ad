"""The lock-step baseline's checkpoint choice (:mod:`experiments.elastic.baseline_worker`)."""

from __future__ import annotations

from experiments.elastic import baseline_worker


def _round(root, r, names):
    directory = root / f"round_{r:06d}"
    directory.mkdir(parents=True)
    for name in names:
        (directory / name).write_bytes(b"")
    return directory


def test_a_round_is_complete_only_with_every_process_file(tmp_path):
    whole = _round(tmp_path, 3, [f"process_{i}.npz" for i in range(4)])
    assert baseline_worker.newest_complete(tmp_path, 4) == whole
    # a process stopped while saving round 4 leaves its temporary file, not its own
    _round(tmp_path, 4, ["process_0.npz", "process_1.npz", "process_2.npz", "process_3.tmp.npz"])
    _round(tmp_path, 5, ["process_0.npz", "process_1.npz"])
    assert baseline_worker.newest_complete(tmp_path, 4) == whole
    assert baseline_worker.newest_complete(tmp_path / "none", 4) is None
