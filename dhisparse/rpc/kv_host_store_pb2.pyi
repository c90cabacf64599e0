from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArenaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("path", "capacity_bytes", "alignment", "store_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    capacity_bytes: int
    alignment: int
    store_id: str
    def __init__(self, path: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., alignment: _Optional[int] = ..., store_id: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("request_id", "owner", "source", "num_rows", "row_bytes", "generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    source: int
    num_rows: int
    row_bytes: int
    generation: int
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., source: _Optional[int] = ..., num_rows: _Optional[int] = ..., row_bytes: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class RegionSpec(_message.Message):
    __slots__ = ("source", "num_rows", "row_bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    source: int
    num_rows: int
    row_bytes: int
    def __init__(self, source: _Optional[int] = ..., num_rows: _Optional[int] = ..., row_bytes: _Optional[int] = ...) -> None: ...

class AllocateManyRequest(_message.Message):
    __slots__ = ("request_id", "owner", "generation", "specs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    generation: int
    specs: _containers.RepeatedCompositeFieldContainer[RegionSpec]
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ..., specs: _Optional[_Iterable[_Union[RegionSpec, _Mapping]]] = ...) -> None: ...

class AllocateManyResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("region_id", "request_id", "owner", "source", "offset", "num_rows", "row_bytes", "durable", "generation")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    request_id: str
    owner: str
    source: int
    offset: int
    num_rows: int
    row_bytes: int
    durable: _containers.RepeatedCompositeFieldContainer[RowRange]
    generation: int
    def __init__(self, region_id: _Optional[str] = ..., request_id: _Optional[str] = ..., owner: _Optional[str] = ..., source: _Optional[int] = ..., offset: _Optional[int] = ..., num_rows: _Optional[int] = ..., row_bytes: _Optional[int] = ..., durable: _Optional[_Iterable[_Union[RowRange, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class MarkDurableRequest(_message.Message):
    __slots__ = ("region_id", "owner", "start_row", "end_row", "generation")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    START_ROW_FIELD_NUMBER: _ClassVar[int]
    END_ROW_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    owner: str
    start_row: int
    end_row: int
    generation: int
    def __init__(self, region_id: _Optional[str] = ..., owner: _Optional[str] = ..., start_row: _Optional[int] = ..., end_row: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class MarkDurableResponse(_message.Message):
    __slots__ = ("durable_rows",)
    DURABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    durable_rows: int
    def __init__(self, durable_rows: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("request_id", "owner", "generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    generation: int
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("owner", "request_id", "region_id", "generation")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    request_id: str
    region_id: str
    generation: int
    def __init__(self, owner: _Optional[str] = ..., request_id: _Optional[str] = ..., region_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "bytes_freed")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    released: int
    bytes_freed: int
    def __init__(self, released: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "regions", "requests", "durable_bytes", "allocations_refused", "largest_free_bytes", "owners_live", "adoptions", "orphans_expired", "prefix_records", "prefix_bytes", "prefix_evictions", "prefix_hits", "owners_fenced", "handovers")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNERS_LIVE_FIELD_NUMBER: _ClassVar[int]
    ADOPTIONS_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FENCED_FIELD_NUMBER: _ClassVar[int]
    HANDOVERS_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    regions: int
    requests: int
    durable_bytes: int
    allocations_refused: int
    largest_free_bytes: int
    owners_live: int
    adoptions: int
    orphans_expired: int
    prefix_records: int
    prefix_bytes: int
    prefix_evictions: int
    prefix_hits: int
    owners_fenced: int
    handovers: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., regions: _Optional[int] = ..., requests: _Optional[int] = ..., durable_bytes: _Optional[int] = ..., allocations_refused: _Optional[int] = ..., largest_free_bytes: _Optional[int] = ..., owners_live: _Optional[int] = ..., adoptions: _Optional[int] = ..., orphans_expired: _Optional[int] = ..., prefix_records: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., owners_fenced: _Optional[int] = ..., handovers: _Optional[int] = ...) -> None: ...

class RegisterOwnerRequest(_message.Message):
    __slots__ = ("owner", "lease_ttl_s", "salt")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    owner: str
    lease_ttl_s: float
    salt: str
    def __init__(self, owner: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., salt: _Optional[str] = ...) -> None: ...

class OwnerLease(_message.Message):
    __slots__ = ("owner", "generation", "lease_ttl_s")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    owner: str
    generation: int
    lease_ttl_s: float
    def __init__(self, owner: _Optional[str] = ..., generation: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class RenewOwnerRequest(_message.Message):
    __slots__ = ("owner", "generation")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    generation: int
    def __init__(self, owner: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleaseOwnerRequest(_message.Message):
    __slots__ = ("owner", "generation")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    owner: str
    generation: int
    def __init__(self, owner: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleaseOwnerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("owner", "adoptable_only")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ADOPTABLE_ONLY_FIELD_NUMBER: _ClassVar[int]
    owner: str
    adoptable_only: bool
    def __init__(self, owner: _Optional[str] = ..., adoptable_only: _Optional[bool] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "owner", "generation", "regions", "bytes", "adoptable", "dead_for_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ADOPTABLE_FIELD_NUMBER: _ClassVar[int]
    DEAD_FOR_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    generation: int
    regions: int
    bytes: int
    adoptable: bool
    dead_for_s: float
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ..., regions: _Optional[int] = ..., bytes: _Optional[int] = ..., adoptable: _Optional[bool] = ..., dead_for_s: _Optional[float] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("request_id", "owner", "generation", "from_owner", "fence", "from_generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FROM_OWNER_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    FROM_GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    generation: int
    from_owner: str
    fence: bool
    from_generation: int
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ..., from_owner: _Optional[str] = ..., fence: _Optional[bool] = ..., from_generation: _Optional[int] = ...) -> None: ...

class AdoptResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class HandOverRequest(_message.Message):
    __slots__ = ("request_id", "owner", "generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    generation: int
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class HandOverResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CachePrefixRequest(_message.Message):
    __slots__ = ("request_id", "owner", "generation", "page_hashes", "token_ids", "page_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    owner: str
    generation: int
    page_hashes: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    page_size: int
    def __init__(self, request_id: _Optional[str] = ..., owner: _Optional[str] = ..., generation: _Optional[int] = ..., page_hashes: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., page_size: _Optional[int] = ...) -> None: ...

class CachePrefixResponse(_message.Message):
    __slots__ = ("cached",)
    CACHED_FIELD_NUMBER: _ClassVar[int]
    cached: bool
    def __init__(self, cached: _Optional[bool] = ...) -> None: ...

class AcquirePrefixRequest(_message.Message):
    __slots__ = ("owner", "generation", "page_hashes", "token_ids", "page_size", "whole")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    generation: int
    page_hashes: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    page_size: int
    whole: bool
    def __init__(self, owner: _Optional[str] = ..., generation: _Optional[int] = ..., page_hashes: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., page_size: _Optional[int] = ..., whole: _Optional[bool] = ...) -> None: ...

class AcquirePrefixResponse(_message.Message):
    __slots__ = ("hit", "lease_id", "pages", "tokens", "regions")
    HIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    lease_id: str
    pages: int
    tokens: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, hit: _Optional[bool] = ..., lease_id: _Optional[str] = ..., pages: _Optional[int] = ..., tokens: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class ReleasePrefixRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleasePrefixResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
