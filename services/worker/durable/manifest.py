"""A session's manifest: everything besides its KV rows and index keys that a successor needs
to resume it, as a self-describing record in a double-buffered region of the host arena.

Layout of the region: two halves of equal size. A half is ``header | payload``; the header is
``magic, version, payload length, crc32(version, length, payload)``. Version v is written to
half ``v % 2``, so the previous version stays intact in the other half while this one is
written: a crash mid-write leaves one half torn (its checksum fails) and the other valid, and a
reader takes the newest valid half. A manifest region is arena bytes that another request's
manifest may have held before (regions are reused as requests end): a fresh region is cleared
before its request can be handed over (``invalidate``), and a reader takes only halves written
for the request it reads (``read``'s ``request_id``), so a stale half — valid, and possibly of a
higher version than the new request's first — never passes for the new request's.

The payload is a JSON head (scalars, lists of small ints, and the offset/length of each binary
blob) followed by the blobs (token ids as int32, the generator state, token-ring snapshots).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np

MAGIC = b"DHSM"
_HEADER = struct.Struct("<4sQII")  # magic, version, payload length, crc32
HEADER_BYTES = _HEADER.size
FORMAT = 1


class ManifestError(RuntimeError):
    """No valid manifest half: never written, both halves torn or corrupt, or written for
    another request."""


@dataclass(frozen=True)
class SessionRecord:
    """A request as a successor needs it. ``num_computed`` tokens have committed KV rows (all
    of ``prompt_ids + output_ids`` but the last, whose row the next step computes)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    num_computed: int
    params: dict  # SamplingParams fields
    committed_rows: list[int]  # per stored KV source: the rows of ``num_computed`` tokens
    generator_state: bytes | None = None  # the request's own generator (seeded sampling)
    rings: dict[int, bytes] = field(default_factory=dict)  # token-ring snapshots by source
    ring_dtype: str = ""
    kv_cache_dtype: str = "auto"  # how its host rows and keys are stored (fp8: packed)
    arrival_s: float = 0.0  # wall-clock arrival, for latency metrics of the resumed request


def encode(rec: SessionRecord) -> bytes:
    blobs: list[bytes] = []
    table: dict[str, list[int]] = {}

    def put(name: str, data: bytes) -> None:
        table[name] = [sum(len(b) for b in blobs), len(data)]
        blobs.append(data)

    put("prompt", np.asarray(rec.prompt_ids, dtype="<i4").tobytes())
    put("output", np.asarray(rec.output_ids, dtype="<i4").tobytes())
    if rec.generator_state is not None:
        put("generator", rec.generator_state)
    for s, raw in sorted(rec.rings.items()):
        put(f"ring{s}", raw)
    head = {
        "format": FORMAT,
        "request_id": rec.request_id,
        "num_computed": rec.num_computed,
        "params": rec.params,
        "committed_rows": rec.committed_rows,
        "ring_dtype": rec.ring_dtype,
        "kv_cache_dtype": rec.kv_cache_dtype,
        "arrival_s": rec.arrival_s,
        "blobs": table,
    }
    j = json.dumps(head, separators=(",", ":")).encode()
    return struct.pack("<I", len(j)) + j + b"".join(blobs)


def decode(payload: bytes) -> SessionRecord:
    (n,) = struct.unpack_from("<I", payload)
    head = json.loads(payload[4 : 4 + n])
    if head.get("format") != FORMAT:
        raise ManifestError(f"unknown manifest format {head.get('format')!r}")
    base = 4 + n

    def get(name: str) -> bytes:
        off, length = head["blobs"][name]
        return bytes(payload[base + off : base + off + length])

    ids = lambda name: np.frombuffer(get(name), dtype="<i4").tolist()  # noqa: E731
    rings = {int(k[4:]): get(k) for k in head["blobs"] if k.startswith("ring")}
    return SessionRecord(
        request_id=head["request_id"],
        prompt_ids=ids("prompt"),
        output_ids=ids("output"),
        num_computed=head["num_computed"],
        params=head["params"],
        committed_rows=head["committed_rows"],
        generator_state=get("generator") if "generator" in head["blobs"] else None,
        rings=rings,
        ring_dtype=head["ring_dtype"],
        kv_cache_dtype=head.get("kv_cache_dtype", "auto"),  # manifests from before fp8
        arrival_s=head["arrival_s"],
    )


def params_dict(params: object) -> dict:
    """A frozen dataclass of sampling parameters as JSON fields (tuples become lists)."""
    return json.loads(json.dumps(asdict(params)))  # type: ignore[call-overload]


def _crc(version: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<QI", version, len(payload))))


def write(buf: np.ndarray, version: int, payload: bytes) -> None:
    """Writes ``payload`` as ``version`` (>= 1) into half ``version % 2`` of ``buf`` ([2, half]
    uint8, the manifest region). The payload goes first and the header last, so even a reader
    racing the writer never trusts a half before its header names it."""
    half = buf.shape[1]
    if HEADER_BYTES + len(payload) > half:
        raise ManifestError(
            f"manifest of {len(payload)} bytes does not fit its half of {half} bytes"
        )
    row = buf[version % 2]
    row[:HEADER_BYTES] = 0  # invalidate first: the old header must not vouch for new bytes
    row[HEADER_BYTES : HEADER_BYTES + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    header = _HEADER.pack(MAGIC, version, len(payload), _crc(version, payload))
    row[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)


def invalidate(buf: np.ndarray) -> None:
    """Clears both halves' headers of ``buf`` ([2, half] uint8, a manifest region just
    allocated): whatever an earlier holder of these bytes wrote reads as never written."""
    buf[:, :HEADER_BYTES] = 0


def _request_id(payload: bytes) -> str:
    (n,) = struct.unpack_from("<I", payload)
    return json.loads(payload[4 : 4 + n]).get("request_id", "")


def read(buf: np.ndarray, request_id: str | None = None) -> tuple[int, bytes]:
    """(version, payload) of the newest valid half — of those written for ``request_id`` when
    given (a half naming another request is stale: an earlier holder's); raises
    ``ManifestError`` when no half is."""
    best: tuple[int, bytes] | None = None
    problems = []
    for h in range(2):
        row = buf[h]
        magic, version, length, crc = _HEADER.unpack(row[:HEADER_BYTES].tobytes())
        if magic != MAGIC:
            problems.append(f"half {h}: never written")
            continue
        if HEADER_BYTES + length > len(row):
            problems.append(f"half {h}: length {length} past the half")
            continue
        payload = row[HEADER_BYTES : HEADER_BYTES + length].tobytes()
        if _crc(version, payload) != crc:
            problems.append(f"half {h}: checksum mismatch (torn or corrupt write)")
            continue
        if request_id is not None and (named := _request_id(payload)) != request_id:
            problems.append(f"half {h}: stale, written for request {named!r}")
            continue
        if best is None or version > best[0]:
            best = (version, payload)
    if best is None:
        raise ManifestError("no valid manifest: " + "; ".join(problems))
    return best


def required_bytes(payload_bound: int) -> int:
    """Bytes of one half for payloads up to ``payload_bound`` bytes (8-byte rows)."""
    return -(-(HEADER_BYTES + payload_bound) // 8) * 8
