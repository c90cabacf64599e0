"""The session manifest: a self-describing record, double-buffered so that a crash mid-write
never leaves it torn — readers take the newest valid half, and say clearly when none is."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from services.worker.durable import manifest
from services.worker.durable.manifest import HEADER_BYTES, ManifestError, SessionRecord
from services.worker.durable.restore import sampling_params
from services.worker.request.request import Grammar, SamplingParams


def record(n_out: int) -> SessionRecord:
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=50, stop=("\n\n",))
    return SessionRecord(
        request_id="req-1",
        prompt_ids=[1, 2, 3, 70000],
        output_ids=list(range(100, 100 + n_out)),
        num_computed=4 + n_out - 1,
        params=manifest.params_dict(params),
        committed_rows=[4 + n_out - 1, (4 + n_out - 1) // 4],
        generator_state=bytes(range(256)) * 3,
        rings={0: b"\x01" * 48, 3: b"\x02" * 16},
        ring_dtype="torch.float32",
        arrival_s=1_700_000_000.25,
    )


def buffer(half: int = 4096) -> np.ndarray:
    return np.zeros((2, half), dtype=np.uint8)


def test_record_round_trips() -> None:
    rec = record(5)
    assert manifest.decode(manifest.encode(rec)) == rec
    assert sampling_params(rec.params) == SamplingParams(
        temperature=0.7, seed=3, max_tokens=50, stop=("\n\n",)
    )


def test_every_sampling_field_round_trips() -> None:
    """Penalties, biases and a grammar survive the manifest's JSON (a resumed session keeps
    its constraints)."""
    params = SamplingParams(
        temperature=0.5, stop=("x",), stop_token_ids=(7, 9), presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.1,
        logit_bias=((3, -1.5), (11, 2.0)), grammar=Grammar("json_schema", '{"type": "object"}'),
        prompt_logprobs=2, skip_special_tokens=False,
    )  # fmt: skip
    assert sampling_params(manifest.params_dict(params)) == params


def test_newest_valid_half_wins() -> None:
    buf = buffer()
    for v in (1, 2, 3):
        manifest.write(buf, v, manifest.encode(record(v)))
    version, payload = manifest.read(buf)
    assert version == 3 and manifest.decode(payload) == record(3)
    assert manifest.read(buf[::-1])[0] == 3  # which half holds it does not matter


@pytest.mark.parametrize("where", ["header", "payload", "length"])
def test_a_corrupt_half_falls_back_to_the_other(where: str) -> None:
    buf = buffer()
    manifest.write(buf, 1, manifest.encode(record(1)))
    manifest.write(buf, 2, manifest.encode(record(2)))
    row = buf[0]  # version 2 lives in half 0
    if where == "header":
        row[8] ^= 0xFF  # the version number
    elif where == "payload":
        row[HEADER_BYTES + 20] ^= 0x01
    else:
        row[12:16] = np.frombuffer((10**6).to_bytes(4, "little"), dtype=np.uint8)
    version, payload = manifest.read(buf)
    assert version == 1 and manifest.decode(payload) == record(1)


def test_a_write_torn_by_a_crash_leaves_the_previous_version() -> None:
    buf = buffer()
    manifest.write(buf, 1, manifest.encode(record(1)))
    manifest.write(buf, 2, manifest.encode(record(2)))
    # Version 3 goes to half 1 (version 1's): the process dies after the header was cleared
    # and half of the payload was written.
    payload = manifest.encode(record(3))
    buf[1, :HEADER_BYTES] = 0
    buf[1, HEADER_BYTES : HEADER_BYTES + len(payload) // 2] = np.frombuffer(
        payload[: len(payload) // 2], dtype=np.uint8
    )
    assert manifest.read(buf)[0] == 2
    # Or it died before writing the header back over a complete payload: still version 2.
    buf[1, HEADER_BYTES : HEADER_BYTES + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    assert manifest.read(buf)[0] == 2


def test_no_valid_half_is_a_clear_error() -> None:
    buf = buffer()
    with pytest.raises(ManifestError, match="half 0: never written; half 1: never written"):
        manifest.read(buf)
    manifest.write(buf, 1, manifest.encode(record(1)))
    manifest.write(buf, 2, manifest.encode(record(2)))
    buf[:, HEADER_BYTES + 5] ^= 0x10
    with pytest.raises(ManifestError, match="checksum mismatch"):
        manifest.read(buf)


def test_a_record_larger_than_its_half_is_refused() -> None:
    payload = manifest.encode(record(400))
    with pytest.raises(ManifestError, match="does not fit"):
        manifest.write(buffer(len(payload)), 1, payload)
    half = manifest.required_bytes(len(payload))
    manifest.write(buffer(half), 1, payload)


def test_a_stale_half_of_a_reused_region_never_passes_for_the_new_request() -> None:
    """A region that held a finished request's manifest (versions up to 40) is reused by a new
    request, which has written its first version (into half 1): the stale half 0 is valid and of
    a higher version, but it names another request."""
    buf = buffer()
    old = replace(record(3), request_id="finished")
    for v in (39, 40):
        manifest.write(buf, v, manifest.encode(old))
    new = record(1)
    manifest.write(buf, 1, manifest.encode(new))
    assert manifest.read(buf)[0] == 40  # what the newest-version rule alone picks
    version, payload = manifest.read(buf, "req-1")
    assert (version, manifest.decode(payload)) == (1, new)
    with pytest.raises(ManifestError, match="stale, written for request 'req-1'"):
        manifest.read(buf, "another")


def test_an_invalidated_region_reads_as_never_written() -> None:
    buf = buffer()
    manifest.write(buf, 7, manifest.encode(record(2)))
    manifest.write(buf, 8, manifest.encode(record(3)))
    manifest.invalidate(buf)
    with pytest.raises(ManifestError, match="half 0: never written; half 1: never written"):
        manifest.read(buf, "req-1")
