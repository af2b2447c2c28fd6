"""Averaging's file I/O: the read-ahead ring hands out every tensor and hash right, and the output sink
writes exactly the bytes it is given, direct or buffered."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers.averaging import average_into, make_checkpoint
from train_deploy.averaging import streaming
from train_deploy.averaging.config import AveragingConfig


@pytest.mark.parametrize("budget", [1, 1 << 30])  # one read ahead (two buffers), or three across tensors
def test_read_ahead_ring_keeps_every_tensor_and_hash_right(tmp_path, monkeypatch, budget):
    import xxhash

    monkeypatch.setattr(streaming, "_READ_AHEAD_BYTES", budget)
    folders = [make_checkpoint(tmp_path / "ck", step=s, seed=s, tensors={
        f"layer{j}.weight": np.random.RandomState(10 * s + j).randn(3 + j, 5).astype(np.float32) for j in range(4)})
        for s in range(1, 6)]
    out = average_into(folders, AveragingConfig(k=5), tmp_path / "out")
    averaged = load_file(str(out / "model.safetensors"))
    sources = [load_file(str(f / "model.safetensors")) for f in folders]
    for key in sources[0]:
        if key == "counter":
            assert (averaged[key] == sources[-1][key]).all()
        else:
            np.testing.assert_allclose(averaged[key], np.mean([s[key] for s in sources], axis=0), rtol=1e-6, atol=1e-7)
    recorded = [s["xxh3_128"] for s in json.loads((out / "state.json").read_text())["averaged"]["sources"]]
    assert recorded == [xxhash.xxh3_128((f / "model.safetensors").read_bytes()).hexdigest() for f in folders]


@pytest.mark.parametrize("direct", [True, False])
def test_the_output_sink_writes_exactly_the_bytes_given_direct_or_buffered(tmp_path, direct):
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in
              (8, 0, 4095, 1, streaming._SINK_BLOCK, 3 * streaming._SINK_BLOCK + 17, 123_457)]
    path = tmp_path / "out.bin"
    with streaming.DirectSink(path, direct=direct) as sink:
        for piece in pieces:
            sink.write(piece)
    assert path.read_bytes() == b"".join(p.tobytes() for p in pieces)
    probe = streaming._open_direct(tmp_path / "probe.bin")  # None where the file system refuses O_DIRECT
    if probe is not None:
        os.close(probe)
    assert sink.direct == (direct and probe is not None)
